"""Simulator server processes: started on loopback, awaited until healthy, stopped by verified PID.

The one implementation behind everything that runs simulators: `scripts/start_user_sims.sh` and
`stop_user_sims.sh` (through `python -m llm_agent.user_sim.instances`), the evaluation's own simulators, the tests
and the benchmarks (`SimulatorGroup`).

A process is named by `ProcessId`: its PID and its start time (clock ticks since boot, `/proc/PID/stat` field 22),
so a PID the kernel has since given to another process is never mistaken for it. Nothing here looks a process up
by name or signals a process group: `stop_process` signals the one PID it was given, after the caller checked it
(`is_our_simulator`: alive since the recorded start, owned by this user, and a simulator server on its port), and
then only the descendants it found under that PID before signalling, each checked the same way. Linux only
(`/proc`); the standard library only, so it starts fast from the shell scripts.
"""
from __future__ import annotations

import contextlib
import ctypes
import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "REPO_ROOT", "SERVER_MODULES", "ProcessId", "ServerSpec", "SimulatorGroup", "SimulatorStartError",
    "descendants", "free_port", "health_ok", "is_our_simulator", "launch", "listens_on", "port_in_use",
    "stop_process", "wait_until_ready",
]  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULES = ("llm_agent.user_sim.server", "vllm.entrypoints.openai.api_server")
"""The `python -m` modules a simulator instance runs: ours and vLLM's OpenAI-compatible server."""
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.1


class SimulatorStartError(RuntimeError):
    """A simulator did not become healthy: it exited, or the deadline passed. `log_path` is its log, if any."""

    def __init__(self, message: str, log_path: Path | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the instance's log ("" without one)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


# ---- /proc: which process is which ----

def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from field 3 (state) on, or None when PID is gone. Field 2 (comm, in
    parentheses) may hold spaces and ')' itself, so the line is split after its LAST ')'."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw.rsplit(b")", 1)[-1].decode(errors="replace").split()


def stat_field(pid: int, field: int) -> str | None:
    """Field `field` (1-based, >= 3) of /proc/PID/stat, or None when PID is gone."""
    fields = _stat_fields(pid)
    return None if fields is None or len(fields) <= field - 3 else fields[field - 3]


def start_ticks(pid: int) -> int:
    """The start time of PID in clock ticks since boot (field 22), or 0 when PID is gone."""
    value = stat_field(pid, 22)
    return int(value) if value and value.isdigit() else 0


@dataclass(frozen=True)
class ProcessId:
    """A process as a PID file records it ("PID START_TICKS"): a reused PID has another start time."""

    pid: int
    start_ticks: int

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The identity of the live process `pid`, or None when it is gone."""
        ticks = start_ticks(pid)
        return cls(pid, ticks) if ticks else None

    @classmethod
    def parse(cls, text: str) -> ProcessId | None:
        """A PID file's record; None unless it holds a positive PID (a missing or bad start time parses as 0,
        which never verifies)."""
        parts = text.split()
        if not parts or not parts[0].isdigit() or int(parts[0]) <= 0:
            return None
        ticks = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        return cls(int(parts[0]), ticks)

    def record(self) -> str:
        """The PID file line."""
        return f"{self.pid} {self.start_ticks}"

    def alive(self) -> bool:
        """True when this very process runs: the PID exists, is not a zombie and started at `start_ticks`."""
        if self.pid <= 0 or self.start_ticks <= 0:
            return False
        fields = _stat_fields(self.pid)
        return fields is not None and len(fields) > 19 and fields[0] != "Z" and fields[19] == str(self.start_ticks)

    def mine(self) -> bool:
        """True when the process runs as this user."""
        try:
            return os.stat(f"/proc/{self.pid}").st_uid == os.getuid()
        except OSError:
            return False


def command_line(pid: int) -> list[str]:
    """The argv of PID ([] when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def runs_simulator_on(pid: int, port: int) -> bool:
    """True when PID's command line is a simulator server (`SERVER_MODULES`) with `--port port`."""
    argv = command_line(pid)
    on_port = any((arg == "--port" and i + 1 < len(argv) and argv[i + 1] == str(port)) or arg == f"--port={port}"
                  for i, arg in enumerate(argv))
    return on_port and any(module in argv for module in SERVER_MODULES)


def is_our_simulator(ident: ProcessId, port: int) -> bool:
    """True when a recorded process may be signalled: alive since its recorded start, ours, a simulator on `port`."""
    return ident.alive() and ident.mine() and runs_simulator_on(ident.pid, port)


def descendants(pid: int) -> list[ProcessId]:
    """Every live descendant of PID that runs as this user (children first, then theirs)."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = stat_field(int(entry.name), 4)
            if parent is not None and parent.isdigit():
                parent_of[int(entry.name)] = int(parent)
    found: list[ProcessId] = []
    frontier = {pid}
    while frontier:
        children = sorted(child for child, parent in parent_of.items() if parent in frontier)
        frontier = set()
        for child in children:
            ident = ProcessId.of(child)
            if ident is not None and ident.mine():
                found.append(ident)
                frontier.add(child)
    return found


def listens_on(pid: int, port: int) -> bool:
    """True when PID holds a TCP socket listening on `port` (so /health answers on that port come from it)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines, None)
            for line in lines:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return False
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(fd.path) in inodes:
                    return True
    return False


# ---- ports and health ----

def free_port() -> int:
    """A loopback port nothing listens on right now (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on host:port."""
    with socket.socket() as sock:
        sock.settimeout(2.0)
        return sock.connect_ex((host, port)) == 0


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def health_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET {url}/health answers 200 (proxy variables ignored: simulators are reached directly)."""
    try:
        with _NO_PROXY.open(f"{url.rstrip('/')}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


# ---- starting ----

@dataclass(frozen=True)
class ServerSpec:
    """What runs on each port: the backend (`scripted` or `hf`: our server; `vllm`: vLLM's OpenAI server), the
    model and scenario, sampling seed and served name, vLLM's sizes, the interpreters, and extra server flags."""

    backend: str = "scripted"
    model: str | None = None
    scenario: str | None = None
    seed: int | None = None
    served_model_name: str | None = None
    tp: int = 1
    max_model_len: int = 8192
    gpu_memory_utilization: str = "0.9"
    python: str = sys.executable
    vllm_python: str = str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    log_level: str | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in ("scripted", "hf", "vllm"):
            raise ValueError(f"backend must be vllm, hf or scripted, got {self.backend!r}")
        if self.backend != "scripted" and not self.model:
            raise ValueError(f"backend {self.backend} needs a model")

    def command(self, port: int) -> list[str]:
        """The server's argv on `port` (loopback)."""
        named = [] if self.served_model_name is None else ["--served-model-name", self.served_model_name]
        seeded = [] if self.seed is None else ["--seed", str(self.seed)]
        if self.backend == "vllm":
            cmd = [self.vllm_python, "-m", SERVER_MODULES[1], "--model", str(self.model), *named, "--host",
                   "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(self.tp), "--max-model-len",
                   str(self.max_model_len), "--gpu-memory-utilization", str(self.gpu_memory_utilization), *seeded]
        else:
            cmd = [self.python, "-m", SERVER_MODULES[0], "--backend", self.backend, "--host", "127.0.0.1", "--port",
                   str(port), *named, *seeded]
            if self.backend == "hf":
                cmd += ["--model", str(self.model)]
            if self.scenario:
                cmd += ["--scenario", str(self.scenario)]
            if self.log_level:
                cmd += ["--log-level", self.log_level]
        return [*cmd, *self.extra_args]

    def environment(self, base: Mapping[str, str], devices: str | None = None,
                    api_key: str | None = None) -> dict[str, str]:
        """The server's environment: `base`, the GPUs it sees, and the API key (never on a command line). vLLM runs
        without the trainer's TORCHDYNAMO_DISABLE and OMP_NUM_THREADS (it needs torch.compile for CUDA graphs)."""
        env = dict(base)
        if self.backend == "vllm":
            env.pop("TORCHDYNAMO_DISABLE", None)
            env.pop("OMP_NUM_THREADS", None)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        if api_key:
            env["SEAD_USER_SIM_API_KEY"] = env["VLLM_API_KEY"] = api_key
        return env


def _child_setup(die_with_parent: bool) -> Callable[[], None]:
    """The preexec_fn of a server: no blocked signals (a starter may hold SIGTERM back while it records the PID,
    and a blocked mask survives exec), and with `die_with_parent` a request that the kernel SIGTERM the child when
    the thread that started it dies (Linux)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if die_with_parent and sys.platform.startswith("linux") else None

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return setup


def launch(command: Sequence[str], env: Mapping[str, str], log_path: Path, *, header: str | None = None,
           die_with_parent: bool = False) -> subprocess.Popen:
    """Start `command` in its own session (cwd the repository root, stdin closed, stdout and stderr appended to
    `log_path`, created owner-only, after `header`); with `die_with_parent` the kernel SIGTERMs it when the
    starting thread dies."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as log:
        if header:
            log.write(header + "\n")
            log.flush()
        return subprocess.Popen(list(command), cwd=REPO_ROOT, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_child_setup(die_with_parent))


def wait_until_ready(instances: Sequence[tuple[int, subprocess.Popen, Path | None]], timeout_s: float) -> None:
    """Wait until every (port, process, log) is ready: the process runs, answers GET /health and holds the port's
    listening socket (so the answer did not come from another process on that port while ours died with "address
    in use"). Raise `SimulatorStartError` when one exits first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    for port, proc, log_path in instances:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise SimulatorStartError(f"instance on port {port} (PID {proc.pid}) exited before becoming healthy "
                                          f"(status {proc.returncode})", log_path)
            if health_ok(url) and listens_on(proc.pid, port):
                break
            if time.monotonic() > deadline:
                raise SimulatorStartError(f"instance on port {port} not healthy within {timeout_s:g}s", log_path)
            time.sleep(_POLL_S)


# ---- stopping ----

def _wait_gone(ident: ProcessId, timeout_s: float, proc: subprocess.Popen | None) -> bool:
    """Wait up to `timeout_s` for the process to end (reaping it when it is our child); True when it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_POLL_S)
        if not ident.alive():
            return True
        if time.monotonic() > deadline:
            return False
        if proc is None:
            time.sleep(_POLL_S)


def _signal(ident: ProcessId, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(ident.pid, sig)


def stop_process(ident: ProcessId, grace_s: float = 20.0, proc: subprocess.Popen | None = None,
                 log: Callable[[str], None] = logger.warning) -> bool:
    """SIGTERM the (already verified) process, SIGKILL it after `grace_s`, then SIGKILL the descendants found under
    it before the first signal that still run (each checked by start time and owner). `proc` is its Popen when it
    is our child (reaped here). True when it is gone."""
    if not ident.alive():
        if proc is not None:
            proc.poll()
        return True
    leftovers = descendants(ident.pid)  # before TERM: an exiting parent orphans its children
    _signal(ident, signal.SIGTERM)
    if not _wait_gone(ident, grace_s, proc):
        _signal(ident, signal.SIGKILL)
        log(f"PID {ident.pid} did not exit within {grace_s:g}s after TERM; sent KILL")
    for child in leftovers:
        if child.alive() and child.mine():
            _signal(child, signal.SIGKILL)
            log(f"killed PID {child.pid} left behind by PID {ident.pid}")
    return _wait_gone(ident, 5.0, proc)


# ---- a group owned by this process ----

class SimulatorGroup:
    """Simulator servers this process starts on loopback ports, waits for and stops (the evaluation's, the tests'
    and the benchmarks' simulators). `procs` maps each base URL to its process. With `die_with_parent` (default)
    the kernel SIGTERMs every server when the thread that started it dies, so none outlives a killed run."""

    def __init__(self, log_dir: str | Path, spec: ServerSpec | None = None, die_with_parent: bool = True) -> None:
        self.log_dir = Path(log_dir)
        self.spec = spec or ServerSpec(log_level="warning")
        self.die_with_parent = die_with_parent
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, *flags: str, port: int | None = None, env: Mapping[str, str] | None = None) -> str:
        """Launch one server (not yet waited for) with extra `flags` and environment `env`; return its base URL."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = self.log_dir / f"user_sim_{port}_{len(self.procs)}.log"
        command = [*self.spec.command(port), *flags]
        self.procs[url] = launch(command, self.spec.environment({**os.environ, **(env or {})}), log_path,
                                 die_with_parent=self.die_with_parent)
        self.logs[url] = log_path
        return url

    def start_many(self, n: int, *flags: str, timeout_s: float = 60.0) -> list[str]:
        """Start `n` servers and wait until all are healthy; on failure stop them all and raise."""
        try:
            urls = [self.start(*flags) for _ in range(n)]
            self.wait_ready(*urls, timeout_s=timeout_s)
        except BaseException:
            self.stop_all()
            raise
        logger.info("started %d %s simulators: %s (PIDs %s)", n, self.spec.backend, ",".join(urls),
                    [self.procs[u].pid for u in urls])
        return urls

    def wait_ready(self, *urls: str, timeout_s: float = 60.0) -> None:
        """Block until every url's server is ready (see `wait_until_ready`); raise naming its log otherwise."""
        instances = [(int(url.rsplit(":", 1)[1]), self.procs[url], self.logs.get(url)) for url in urls]
        try:
            wait_until_ready(instances, timeout_s)
        except SimulatorStartError as err:
            raise SimulatorStartError(f"{err}; see {err.log_path or self.log_dir}", err.log_path) from None

    def kill(self, url: str) -> None:
        """SIGKILL the server behind `url` (a crash, for fault tests) and reap it."""
        proc = self.procs[url]
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)

    def stop(self, url: str, grace_s: float = 5.0) -> None:
        """Stop the server behind `url` (our child, so its PID cannot have been reused): TERM, then KILL."""
        proc = self.procs[url]
        ident = ProcessId.of(proc.pid) if proc.poll() is None else None
        if ident is not None:
            stop_process(ident, grace_s, proc, log=lambda text: logger.warning("simulator %s: %s", url, text))
        proc.poll()

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every server this group started (TERM to all first, so they shut down side by side)."""
        running = {url: proc for url, proc in self.procs.items() if proc.poll() is None}
        for proc in running.values():
            proc.terminate()
        for url in running:
            self.stop(url, grace_s)

    def __enter__(self) -> SimulatorGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
