"""Simulator instances recorded in a run directory: the commands behind scripts/start_user_sims.sh and
scripts/stop_user_sims.sh (`python -m llm_agent.user_sim.instances start|stop ...`, see `--help`).

`start` launches one instance per port (each in its own session), records it in RUN_DIR/user_sim_<port>.pid as
"PID START_TICKS" with its log in RUN_DIR/user_sim_<port>.log, waits until every instance is ready (alive,
answering GET /health, holding its port's listening socket), then writes the comma-separated base URLs to
RUN_DIR/user_sim_urls.txt and prints them last. On failure (an instance exits, the deadline passes, SIGINT,
SIGTERM or SIGHUP) it shows the log tail, stops the instances this call started and exits 1; a bad option exits 2.
`stop` signals a recorded process only when it is verifiably ours (`processes.is_our_simulator`) and removes the
PID files. One start or stop at a time per run directory (a lock on RUN_DIR/user_sims.lock); every file written
is owner-only. The API key reaches the servers through their environment (vLLM: VLLM_API_KEY), never argv.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llm_agent.api_keys import ApiKeyError, KeySafeArgumentParser, api_key, command_line_refusal
from llm_agent.user_sim.processes import (REPO_ROOT, ProcessId, ServerSpec, SimulatorStartError, is_our_simulator,
                                          launch, port_in_use, stop_process, wait_until_ready)

__all__ = ["RunDir", "StartOptions", "main", "start_instances", "stop_instances"]

API_KEY_ENV = "SEAD_USER_SIM_API_KEY"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class UsageError(Exception):
    """A bad option or environment value (exit status 2)."""


class StartFailed(SimulatorStartError):
    """The start did not complete (exit status 1); `log_path` is the failing instance's log, if any."""


class _Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived during a start."""


class RunDir:
    """A run directory: the PID file and log of each port, the URL list and the start/stop lock."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pid_file(self, port: int) -> Path:
        """RUN_DIR/user_sim_<port>.pid."""
        return self.path / f"user_sim_{port}.pid"

    def log_file(self, port: int) -> Path:
        """RUN_DIR/user_sim_<port>.log."""
        return self.path / f"user_sim_{port}.log"

    @property
    def urls_file(self) -> Path:
        """RUN_DIR/user_sim_urls.txt."""
        return self.path / "user_sim_urls.txt"

    def pid_files(self) -> list[Path]:
        """Every PID file, sorted."""
        return sorted(self.path.glob("user_sim_*.pid"))

    def read(self, pid_file: Path) -> ProcessId | None:
        """The record of a PID file (None when it holds no PID)."""
        try:
            return ProcessId.parse(pid_file.read_text())
        except OSError:
            return None

    @contextlib.contextmanager
    def lock(self, wait_s: float, holder: str) -> Iterator[None]:
        """Hold RUN_DIR/user_sims.lock, waiting up to `wait_s` for another start or stop; StartFailed otherwise."""
        fd = os.open(self.path / "user_sims.lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StartFailed(f"another start/stop is running on {self.path} (lock "
                                          f"{self.path / 'user_sims.lock'}); {holder}") from None
                    time.sleep(0.1)
            yield
        finally:
            os.close(fd)


# ---- start ----

@dataclass
class StartOptions:
    """A checked start request: the ports, the server each runs, the GPUs, the deadline and the run directory."""

    ports: list[int]
    spec: ServerSpec
    run_dir: Path
    gpus: list[str] = field(default_factory=list)
    health_timeout_s: int = 120
    api_key: str | None = field(default=None, repr=False)

    def devices(self, index: int) -> str | None:
        """CUDA_VISIBLE_DEVICES of instance `index`: TP consecutive GPUs for vLLM, one GPU (round robin) else."""
        if not self.gpus:
            return None
        if self.spec.backend == "vllm":
            return ",".join(self.gpus[index * self.spec.tp:(index + 1) * self.spec.tp])
        return self.gpus[index % len(self.gpus)]


def _absolute(path: str, base: Path) -> str:
    return path if os.path.isabs(path) else str(base / path)


def _uint(value: str, message: str) -> int:
    if not value.isdigit():
        raise UsageError(message)
    return int(value)


def _read_api_key(key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key-file (a private, non-empty file of this user) or the environment."""
    try:
        return api_key(API_KEY_ENV, key_file or None, environ=environ)
    except ApiKeyError as err:
        raise UsageError(str(err)) from None


class _Parser(KeySafeArgumentParser):
    """A KeySafeArgumentParser whose errors exit 2 through UsageError (an unknown option named, its value not)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message.replace("unrecognized option(s)", "unknown option(s)") + " (see --help)")


def _start_parser() -> _Parser:
    p = _Parser(prog="start_user_sims",
                description="Start simulator instances on loopback, wait until each is healthy, record their PIDs. "
                            "Every option also reads the environment variable in brackets. Arguments after -- go "
                            "to every server.")
    e = os.environ.get
    p.add_argument("--num-instances", default=e("NUM_INSTANCES", "1"), help="[NUM_INSTANCES] (1)")
    p.add_argument("--base-port", default=e("BASE_PORT", "5000"), help="[BASE_PORT] ports BASE.. (5000)")
    p.add_argument("--ports", default=e("PORTS", ""), help="[PORTS] P1,P2,... instead of --num-instances/--base-port")
    p.add_argument("--gpus", default=e("GPUS", ""), help="[GPUS] 0,1,...: TP GPUs per vLLM instance, one per hf one")
    p.add_argument("--tp", default=e("TP", "1"), help="[TP] vLLM tensor parallel size (1)")
    p.add_argument("--model", default=e("MODEL", ""), help="[MODEL] model directory (vllm, hf)")
    p.add_argument("--backend", default=e("USER_SIM_BACKEND", ""),
                   help="[USER_SIM_BACKEND] vllm (default with a model) | hf | scripted (default without)")
    p.add_argument("--scenario", default=e("SCENARIO", ""), help="[SCENARIO] scenario YAML (scripted, hf)")
    p.add_argument("--run-dir", default=e("RUN_DIR", "outputs/run"), help="[RUN_DIR] (outputs/run)")
    p.add_argument("--served-model-name", default=e("SERVED_MODEL_NAME", "user-sim"), help="[SERVED_MODEL_NAME]")
    p.add_argument("--api-key", help=argparse.SUPPRESS)
    p.add_argument("--api-key-file", default=e("API_KEY_FILE", ""),
                   help=f"[API_KEY_FILE] a mode-0600 file holding the key (else ${API_KEY_ENV})")
    p.add_argument("--timeout", default=e("HEALTH_TIMEOUT", ""), help="[HEALTH_TIMEOUT] seconds (600 vllm, 120 else)")
    p.add_argument("--seed", default=e("SEED", "0"),
                   help="[SEED] the same for every instance, so a retry elsewhere answers identically (0)")
    p.add_argument("--max-model-len", default=e("MAX_MODEL_LEN", "8192"), help="[MAX_MODEL_LEN] vllm (8192)")
    p.add_argument("--gpu-memory-utilization", default=e("GPU_MEMORY_UTILIZATION", "0.9"),
                   help="[GPU_MEMORY_UTILIZATION] vllm (0.9)")
    p.add_argument("--caller-dir", default=os.getcwd(), help="relative paths are relative to this directory")
    return p


def parse_start(argv: Sequence[str], environ: Mapping[str, str]) -> StartOptions:
    """Check a start command line (and the environment's defaults) into StartOptions; UsageError naming the option."""
    argv = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = _start_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.api_key is not None:
        raise UsageError(command_line_refusal("--api-key", API_KEY_ENV))
    base = Path(args.caller_dir)
    backend = args.backend or ("vllm" if args.model else "scripted")
    if backend not in ("vllm", "hf", "scripted"):
        raise UsageError(f"--backend must be vllm, hf or scripted, got '{backend}'")
    if backend != "scripted" and not args.model:
        raise UsageError(f"--backend {backend} needs --model (or MODEL=...)")
    tp = _uint(args.tp, f"--tp must be a positive integer, got '{args.tp}'")
    if tp < 1:
        raise UsageError(f"--tp must be a positive integer, got '{args.tp}'")
    if args.ports:
        port_texts = args.ports.split(",")
    else:
        n = _uint(args.num_instances, f"--num-instances must be >= 1, got '{args.num_instances}'")
        if n < 1:
            raise UsageError(f"--num-instances must be >= 1, got '{args.num_instances}'")
        first = _uint(args.base_port, f"--base-port must be a port number, got '{args.base_port}'")
        port_texts = [str(first + i) for i in range(n)]
    ports = [_uint(text, f"invalid port '{text}'") for text in port_texts]
    if bad := [p for p in ports if not 1 <= p <= 65535]:
        raise UsageError(f"invalid port '{bad[0]}'")
    gpus = args.gpus.split(",") if args.gpus else []
    if backend == "vllm" and gpus and len(gpus) < len(ports) * tp:
        raise UsageError(f"{len(ports)} instance(s) x TP {tp} need {len(ports) * tp} GPUs, --gpus lists {len(gpus)}")
    timeout = args.timeout or ("600" if backend == "vllm" else "120")
    health_timeout_s = _uint(timeout, f"--timeout must be whole seconds, got '{timeout}'")
    if not args.seed.lstrip("-").isdigit():
        raise UsageError(f"--seed must be an integer, got '{args.seed}'")
    max_model_len = _uint(args.max_model_len, f"--max-model-len must be a positive integer, got '{args.max_model_len}'")
    if max_model_len < 1:
        raise UsageError(f"--max-model-len must be a positive integer, got '{args.max_model_len}'")
    model = args.model
    if model and os.path.exists(_absolute(model, base)):
        model = _absolute(model, base)  # else a hub id, passed through
    vllm_python = environ.get("VLLM_PYTHON") or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    spec = ServerSpec(backend=backend, model=model or None,
                      scenario=_absolute(args.scenario, base) if args.scenario else None, seed=int(args.seed),
                      served_model_name=args.served_model_name, tp=tp, max_model_len=max_model_len,
                      gpu_memory_utilization=args.gpu_memory_utilization, python=sys.executable,
                      vllm_python=_absolute(vllm_python, base) if "/" in vllm_python else vllm_python,
                      extra_args=tuple(extra))
    api_key = _read_api_key(_absolute(args.api_key_file, base) if args.api_key_file else None, environ)
    return StartOptions(ports=ports, spec=spec, run_dir=Path(_absolute(args.run_dir, base)), gpus=gpus,
                        health_timeout_s=health_timeout_s, api_key=api_key)


def _raise_interrupted(signum: int, frame: object) -> None:
    """The start's handler of SIGINT/SIGTERM/SIGHUP: ignore further ones (the clean-up must complete), then
    unwind."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise _Interrupted


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back while a process is launched and recorded (delivered right after)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def _say(prog: str, text: str) -> None:
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


def start_instances(opts: StartOptions, environ: Mapping[str, str]) -> list[str]:
    """Start, record and await the instances of `opts` (see the module docstring); StartFailed on failure, after
    stopping what this call started. Returns the base URLs."""
    run = RunDir(opts.run_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    base_env = {k: v for k, v in environ.items() if k != API_KEY_ENV}
    started: dict[int, tuple[ProcessId, object]] = {}
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in _SIGNALS}
    try:
        with run.lock(0.0, "a second call fails at once"):
            try:
                _launch_all(opts, run, base_env, started)
                wait_until_ready([(port, proc, run.log_file(port)) for port, (_, proc) in started.items()],
                                 opts.health_timeout_s)
            except BaseException as err:
                _abort(run, started)
                if isinstance(err, _Interrupted):
                    raise StartFailed("interrupted; stopping the instances this call started") from None
                if isinstance(err, SimulatorStartError):
                    raise StartFailed(str(err), err.log_path) from None
                raise
            urls = [f"http://127.0.0.1:{port}" for port in opts.ports]
            run.urls_file.write_text(",".join(urls) + "\n")
            return urls
    except _Interrupted:
        raise StartFailed("interrupted before any instance started") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _launch_all(opts: StartOptions, run: RunDir, env: Mapping[str, str], started: dict) -> None:
    """Launch one instance per port, after checking that the port is free and its PID file stale or absent."""
    for index, port in enumerate(opts.ports):
        pid_file = run.pid_file(port)
        old = run.read(pid_file) if pid_file.exists() else None
        if old is not None and is_our_simulator(old, port):
            raise StartFailed(f"port {port} already has a running instance (PID {old.pid} in {pid_file}); "
                              "stop it first")
        pid_file.unlink(missing_ok=True)  # stale: that process is gone (or its PID now belongs to someone else)
        if port_in_use(port):
            raise StartFailed(f"port {port} is already in use by a process not started here; choose another port")
        if opts.spec.backend == "vllm" and not os.access(opts.spec.vllm_python, os.X_OK):
            raise StartFailed(f"VLLM_PYTHON={opts.spec.vllm_python} is not an executable python "
                              "(install requirements_vllm.txt)")
        command = opts.spec.command(port)
        server_env = opts.spec.environment(env, opts.devices(index), opts.api_key)
        with _signals_deferred():
            proc = launch(command, server_env, run.log_file(port), header=f"start_user_sims: port {port}: "
                          + " ".join(command))
            ident = ProcessId.of(proc.pid) or ProcessId(proc.pid, 0)
            started[port] = (ident, proc)
            pid_file.write_text(ident.record() + "\n")
        if not ident.start_ticks:
            raise StartFailed(f"instance on port {port} (PID {proc.pid}) exited at once", run.log_file(port))
        _say("start_user_sims", f"started {opts.spec.backend} instance on port {port} (PID {proc.pid}, log "
                                f"{run.log_file(port)})")


def _abort(run: RunDir, started: dict) -> None:
    """Stop the instances this call started (our children: their PIDs cannot have been reused) and remove their
    PID files; further signals are ignored meanwhile so that the clean-up completes."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    for port, (ident, proc) in started.items():
        if ident.start_ticks and not stop_process(ident, 20.0, proc,
                                                  log=lambda text: _say("start_user_sims", text)):
            _say("start_user_sims", f"PID {ident.pid} still alive after KILL")
            continue
        proc.poll()
        run.pid_file(port).unlink(missing_ok=True)


# ---- stop ----

def _stop_parser() -> _Parser:
    p = _Parser(prog="stop_user_sims",
                description="Stop the instances recorded in a run directory, and nothing else.")
    e = os.environ.get
    p.add_argument("--run-dir", default=e("RUN_DIR", "outputs/run"), help="[RUN_DIR] (outputs/run)")
    p.add_argument("--ports", default=e("PORTS", ""), help="[PORTS] P1,P2,... (default: every PID file)")
    p.add_argument("--grace", default=e("STOP_GRACE", "20"), help="[STOP_GRACE] seconds between TERM and KILL (20)")
    p.add_argument("--caller-dir", default=os.getcwd(), help="relative paths are relative to this directory")
    return p


def _unverified(ident: ProcessId, port: int) -> str | None:
    """Why a live process that a PID file may still rightly name cannot be signalled; None when the recorded
    process is gone (no process with that PID, or one started at another time than recorded)."""
    live = ProcessId.of(ident.pid)
    if live is None or (ident.start_ticks > 0 and live.start_ticks != ident.start_ticks):
        return None
    if ident.start_ticks <= 0:
        return "has no start time to verify"
    if not ident.mine():
        return "is not yours"
    return f"is not a simulator on port {port}"


def stop_instances(run_dir: Path, ports: Sequence[int] | None = None, grace_s: float = 20.0) -> int:
    """Stop the recorded instances of `run_dir` (the given ports, else every PID file) that are verifiably ours;
    remove their PID files (and the URL list once none is left) and the files of processes that are gone. A file
    naming a live process that cannot be verified is kept and the process left alone. 0 when every recorded
    instance is gone, 1 otherwise."""
    run = RunDir(run_dir)
    if not run.path.is_dir():
        return 0
    status = 0
    with run.lock(60.0, "try again when it ends"):
        pid_files = [run.pid_file(p) for p in ports] if ports else run.pid_files()
        for pid_file in pid_files:
            if not pid_file.exists():
                _say("stop_user_sims", f"no PID file {pid_file}")
                continue
            port = int(pid_file.stem.removeprefix("user_sim_"))
            ident = run.read(pid_file)
            if ident is None:
                _say("stop_user_sims", f"{pid_file} does not hold a PID; removing it")
                pid_file.unlink(missing_ok=True)
                continue
            if not is_our_simulator(ident, port):
                if reason := _unverified(ident, port):  # it may be the instance: keep its only record, fail
                    _say("stop_user_sims", f"PID {ident.pid} from {pid_file} runs but {reason}; not signalling it; "
                                           "the file is kept")
                    status = 1
                else:
                    _say("stop_user_sims", f"PID {ident.pid} from {pid_file} is not running (or its PID was reused "
                                           "by a process started later); removing the file")
                    pid_file.unlink(missing_ok=True)
                continue
            if not stop_process(ident, grace_s, log=lambda text: _say("stop_user_sims", text)):
                _say("stop_user_sims", f"PID {ident.pid} still alive after KILL")
                status = 1
                continue
            pid_file.unlink(missing_ok=True)
            _say("stop_user_sims", f"stopped PID {ident.pid} ({pid_file})")
        if not run.pid_files():
            run.urls_file.unlink(missing_ok=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """`start ...` or `stop ...`: the exit status (0 done, 1 failed, 2 bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else ""
    prog = {"start": "start_user_sims", "stop": "stop_user_sims"}.get(command)
    if prog is None:
        print("usage: python -m llm_agent.user_sim.instances start|stop [options] (see start --help)", file=sys.stderr)
        return 2
    os.umask(0o077)  # PID files, logs, the URL list and the lock: owner only
    try:
        if command == "start":
            urls = start_instances(parse_start(argv, os.environ), os.environ)
            _say(prog, f"{len(urls)} instance(s) healthy")
            print(",".join(urls), flush=True)
            return 0
        args = _stop_parser().parse_args(argv)
        grace = _uint(args.grace, f"--grace must be whole seconds, got '{args.grace}'")
        ports = [_uint(p, f"invalid port '{p}'") for p in args.ports.split(",")] if args.ports else None
        return stop_instances(Path(_absolute(args.run_dir, Path(args.caller_dir))), ports, grace)
    except UsageError as err:
        _say(prog, str(err))
        return 2
    except StartFailed as err:
        _say(prog, str(err))
        if tail := err.log_tail():
            print(f"---- last 40 lines of {err.log_path} ----\n{tail}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
