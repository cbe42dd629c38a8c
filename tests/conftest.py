"""Shared pytest fixtures (a local Ray instance, the tiny and the warm-started model), a quiet CPU-only environment,
and the check that a test which starts processes says so with a marker (see `pytest_runtest_call`)."""
from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from pathlib import Path

import pytest

for _key, _value in {
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "WANDB_MODE": "offline",
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

PROCESS_MARKERS = ("slow", "processes", "vllm", "gpu")
_spawned: list[str] = []


def _counting(launch):
    """Wrap a process-creating function so that every call is recorded in `_spawned`."""
    def counted(*args, **kwargs):
        _spawned.append(launch.__name__)
        return launch(*args, **kwargs)

    return counted


# subprocess, multiprocessing's spawn/forkserver and Ray create processes through fork_exec (or posix_spawn);
# multiprocessing's fork start method through fork
_posixsubprocess.fork_exec = subprocess._fork_exec = _counting(_posixsubprocess.fork_exec)
os.fork = _counting(os.fork)
os.posix_spawn = _counting(os.posix_spawn)
os.posix_spawnp = _counting(os.posix_spawnp)


def pytest_collection_modifyitems(config, items):
    """Order the tests for `make test`'s two pytest-xdist workers: the `vllm` tests and the modules holding `slow`
    tests first, so that the longest ones start early instead of ending the run alone. (Tests that must not run at
    once take a machine lock, tests/helpers/machine_lock.py: pytest-xdist's groups are not applied under pytest 9.2.)"""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (not item.get_closest_marker("vllm"), item.path not in slow_modules))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _spawned.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a test that started a process (in its fixtures or body) without a marker that keeps it out of
    `make test-fast`: `processes` (Ray, servers, subprocesses; <= 30 s), or `slow` (> 30 s)."""
    result = yield
    if _spawned and not any(item.get_closest_marker(name) for name in PROCESS_MARKERS):
        pytest.fail(f"{item.nodeid} started {len(_spawned)} process(es) ({', '.join(sorted(set(_spawned)))}) but is "
                    "not marked `processes` (or `slow` when it takes over 30 s)", pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After a run that included the documentation tests, list the README/docs command blocks CI does not run
    (unmarked, `gpu`, `manual`; tests/helpers/doc_blocks.py)."""
    ran = {report.nodeid.split("::")[0] for reports in terminalreporter.stats.values() for report in reports
           if hasattr(report, "nodeid")}
    if "tests/test_readme_recipes.py" in ran:
        from tests.helpers.doc_blocks import doc_blocks, inventory

        terminalreporter.write_sep("-", "documentation command blocks CI does not run (unmarked, gpu, manual)")
        terminalreporter.write_line(inventory(doc_blocks()))


@pytest.fixture()
def ray_cluster():
    """A local Ray instance for one test (8 logical CPUs: placement needs slots, not cores)."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def scenario():
    """The default scenario (the outbound advertising trial)."""
    from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario

    return load_scenario(DEFAULT_SCENARIO_PATH)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Directory of the tiny Qwen2 model and tokenizer (shared by both test passes, see tests/helpers/model_cache)."""
    from tests.helpers.model_cache import cached_model, producer_key
    from utils.make_tiny_model import build_tiny_model

    return str(cached_model("tiny_model", producer_key(model="tiny", seed=0), lambda out: build_tiny_model(out, 0)))


@pytest.fixture(scope="session")
def warm_model_path(tiny_model_path) -> str:
    """The tiny model fine-tuned (160 SFT steps, ~40 s to build) on scripted SOP-following calls with the compact
    system prompt, so that about half of its sampled turns and most of its greedy ones carry the reply tag and
    reach the simulator. (At 80 steps the loss was still ~1.1, just before it falls: on 2026-11-25 that model's
    greedy turns were all format errors, while on the machine the tests were written on it had passed.)"""
    from llm_agent.scenario import DEFAULT_SCENARIO_PATH
    from tests.helpers.model_cache import cached_model, producer_key
    from tests.helpers.repo import COMPACT_SYSTEM_PROMPT
    from utils.sft_warm_start import scripted_dialogues, sft_on_dialogues

    recipe = {"model": "warm", "base": Path(tiny_model_path).name, "dialogues": 32, "max_turns": 4, "steps": 160,
              "lr": 1e-2, "batch_size": 8, "seed": 0, "system_prompt": COMPACT_SYSTEM_PROMPT}

    def build(out: Path) -> None:
        dialogues = scripted_dialogues(str(DEFAULT_SCENARIO_PATH), 32, {"good": 1.0}, seed=0, max_turns=4,
                                       system_prompt=COMPACT_SYSTEM_PROMPT)
        sft_on_dialogues(tiny_model_path, out, dialogues, steps=160, lr=1e-2, batch_size=8, seed=0)

    return str(cached_model("warm_model", producer_key(**recipe), build))


@pytest.fixture()
def no_process_group():
    """No default torch.distributed group in this process: an earlier module's in-process engine (vLLM, on the same
    xdist worker) may have left one behind, and the memory trace must start its own fake one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
