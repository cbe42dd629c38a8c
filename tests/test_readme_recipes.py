"""The command blocks of README.md and docs/*.md, run as written (tests/helpers/doc_blocks.py: the marker before each
block says how it is covered).

Every command block is marked; the `run` blocks run in a fresh clone (the tracked and untracked files, `.venv`
linked) with `.venv` activated as the README documents, each in its own shell, and must exit 0; `slow` ones the same
in the `extended` pass; `overrides` blocks must load as trainer configs; the blocks CI does not run are printed
(`python -m tests.helpers.doc_blocks` prints them too). Two blocks that need a run of `make demo` are driven by
their own tests here, in a directory laid out as `make demo` leaves it: the evaluation recipe (a checkpoint with
the CPU demo's training config, the prompt data it names; each command's own `main` on the README's arguments,
in process, while the scripted simulators evaluate.py starts are real processes) and the run-inspection recipe
(two synthetic runs in main.sh's layout and the evaluation's dialogues).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from utils.create_prompt_data import create_prompt_data
from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import load_config
from verl.utils.checkpoint import save_trainer_state
from verl.utils.run_config import save_run_config

from tests.helpers.doc_blocks import DocBlock, block_driven_by, doc_blocks, inventory
from tests.helpers.repo import COMPACT_SYSTEM_PROMPT, REPO, SCENARIO_PATH

# the CPU demo's settings (verl/trainer/config/preset/cpu.yaml, utils/cpu_recipe.py, scripts/main.sh): the
# README's command must not override them
DEMO_MAX_TURNS = 10
DEMO_LOOP = {"max_turns": DEMO_MAX_TURNS, "max_tokens_per_turn": 64, "max_response_length": 768, "max_user_tokens": 48,
             "seed": 0}
DEMO_MAX_PROMPT_LENGTH = 96  # its compact agent prompt


EVALUATION_TEST = "tests/test_readme_recipes.py::test_the_evaluation_recipe_runs_as_written"
INSPECTION_TEST = "tests/test_readme_recipes.py::test_the_run_inspection_recipe_runs_as_written"
# what a clean shell has not: the scripts' and the tests' settings
CLEARED = ("PYTHON", "PRESET", "MODEL_PATH", "OUTPUT_DIR", "STEPS", "SCENARIO", "USER_SIM_URLS", "USER_SIM_MODEL",
           "VIRTUAL_ENV", "PYTHONPATH", "PRINT_CONFIG_ONLY", "EXPERIMENT")


def recipe_commands(test_id: str) -> list[list[str]]:
    """The commands of the block marked as driven by `test_id`, split into words."""
    return [shlex.split(command, comments=True) for command in block_driven_by(test_id).commands()]


def demo_checkpoint(root, model_path, step, experiment):
    """`root/global_step_<step>` as the CPU demo saves it (trainer.save_hf_model=every: the HF export in actor/),
    with the training config the evaluation takes its defaults from."""
    step_dir = root / f"global_step_{step}"
    shutil.copytree(model_path, step_dir / "actor")
    save_trainer_state(step_dir, {"global_step": step})
    config = {"data": {"val_files": f"outputs/prompt_data/{experiment}/test.parquet",
                       "max_prompt_length": DEMO_MAX_PROMPT_LENGTH},
              "rollout_loop": {"config": {"scenario": str(SCENARIO_PATH), **DEMO_LOOP}}}
    save_run_config(step_dir, config, cwd=str(root.parents[2]))
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


@pytest.mark.processes
def test_the_evaluation_recipe_runs_as_written(warm_model_path, tmp_path, monkeypatch, capsys):
    commands = recipe_commands(EVALUATION_TEST)
    assert [c[:2] for c in commands] == [["python", f"for_evaluation/{name}.py"]
                                         for name in ("evaluate", "metrics_table", "report")]
    argv = commands[0]
    name, _, checkpoint = argv[argv.index("--agent") + 1].partition("=")
    experiment = checkpoint.rstrip("/").rsplit("/", 1)[-1]
    demo_checkpoint(tmp_path / checkpoint, warm_model_path, 2, experiment)
    create_prompt_data(SCENARIO_PATH, tmp_path / "outputs" / "prompt_data" / experiment, train_samples=1,
                       test_samples=3, seed=5, system_prompt=COMPACT_SYSTEM_PROMPT)
    monkeypatch.chdir(tmp_path)  # outputs/ is here
    outputs = []
    for command in commands:
        module = importlib.import_module("for_evaluation." + command[1].removeprefix("for_evaluation/")[:-3])
        assert module.main(command[2:]) in (None, 0), command
        outputs.append(capsys.readouterr().out)

    out_dir = tmp_path / argv[argv.index("--out") + 1]
    results = json.loads((out_dir / f"{name}_results.json").read_text())
    assert results["global_step"] == 2 and results["n_dialogues"] == 3
    assert {k: results["settings"][k] for k in DEMO_LOOP} == DEMO_LOOP  # the checkpoint's own, not shorter defaults
    assert results["settings"]["max_prompt_length"] == DEMO_MAX_PROMPT_LENGTH
    assert f"max_turns={DEMO_MAX_TURNS}" in outputs[0] and f"{name} at global_step 2: 3 dialogues" in outputs[0]
    assert re.search(rf"^\s*{name}\s+3\s", outputs[1], re.M), outputs[1]  # the table's row of the agent
    report = out_dir / f"{name}_report.html"
    assert outputs[2].strip() == str(report.relative_to(tmp_path)) and 'id="headline"' in report.read_text()
    assert not out_dir.is_relative_to(tmp_path / "outputs" / "evaluation"), \
        "the evaluation writes into the trainer's validation-metrics folder (outputs/evaluation/<experiment>/)"


def _run_main(command: list[str]) -> str:
    """`python for_evaluation/<name>.py ARGS` as its module's `main(ARGS)`, in process."""
    assert command[0] == "python" and command[1].startswith("for_evaluation/"), command
    module = importlib.import_module("for_evaluation." + command[1].removeprefix("for_evaluation/")[:-3])
    assert module.main(command[2:]) in (None, 0), command
    return module.__name__


@pytest.mark.extended  # 28 s measured on a quiet box: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow  # 80 s on a loaded 2-core box: every figure drawn three times, two reports
def test_the_run_inspection_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    from llm_agent.scenario import load_scenario
    from tests.helpers.report_fixtures import synthetic_dialogues, write_run

    scenario = load_scenario(SCENARIO_PATH)
    commands = recipe_commands(INSPECTION_TEST)
    outputs = tmp_path / "outputs"
    runs = sorted({part.split("/")[2] for c in commands for part in c if part.startswith("outputs/logs/")})
    for name in [*runs, "cpu_demo_outbound_ad_trial"]:  # the demo's run last: the latest one
        write_run(outputs, name, scenario, steps=2, n_dialogues=20)
    evaluations = [part for c in commands for part in c if part.endswith("_dialogues.jsonl")]
    assert evaluations == [block_driven_by(EVALUATION_TEST).commands()[-1].split()[-1]]  # the evaluation's own file
    dialogues = synthetic_dialogues(scenario, 20, seed=4, steps=1)
    for d in dialogues:
        d["split"] = "eval"
    (tmp_path / evaluations[0]).parent.mkdir(parents=True)
    (tmp_path / evaluations[0]).write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    monkeypatch.chdir(tmp_path)
    for command in commands:
        _run_main(command)
        capsys.readouterr()
    assert list((outputs / "plots" / "cpu_demo_outbound_ad_trial").glob("*.png"))
    assert list((outputs / "plots" / "a_vs_b").glob("*.png")) or not runs
    assert (outputs / "reports" / "cpu_demo_outbound_ad_trial.html").is_file()
    assert (tmp_path / evaluations[0].replace("_dialogues.jsonl", "_report.html")).is_file()


@pytest.mark.processes
def test_the_run_files_the_readme_names_are_where_main_sh_writes_them(tmp_path):
    """"Looking at a run" names the files of a run as main.sh's dry run passes them to the trainer (it once named
    outputs/evaluation/val_metrics.jsonl, while main.sh writes outputs/evaluation/<experiment>/val_metrics.jsonl)."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    done = subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), "--dry-run"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    experiment = re.search(r"trainer\.experiment_name=(\S+)", done.stdout).group(1)
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## Looking at a run", 1)[1].split("\n## ", 1)[0]
    text = re.sub(r"\s+", " ", section)
    for key in ("trainer.log_dir", "rollout_loop.config.rollout_log_path", "rollout_loop.config.val_metrics_path"):
        path = re.search(rf"{re.escape(key)}=(\S+)", done.stdout).group(1).replace(experiment, "<experiment>")
        named = path if path.endswith(".jsonl") else f"{path}/metrics.jsonl"
        assert f"`{named}`" in text, f"README's 'Looking at a run' does not name {named} ({key})"


def test_every_doc_command_block_is_marked():
    blocks = doc_blocks()
    unmarked = [b.where for b in blocks if b.kind is None]
    assert not unmarked, (f"command blocks without a marker (tests/helpers/doc_blocks.py says which): {unmarked}")
    for block in blocks:
        if block.kind == "test":
            path, _, name = block.note.partition("::")
            assert (REPO / path).is_file() and f"def {name}(" in (REPO / path).read_text(), block.where
    assert {b.kind for b in blocks} >= {"run", "slow", "test", "gpu", "overrides", "manual"}
    assert "UNMARKED" not in inventory(blocks)  # the list tests/conftest.py prints after the run


def test_override_blocks_load_as_trainer_configs(tmp_path):
    model, data = tmp_path / "model", tmp_path / "train.parquet"
    model.mkdir()
    data.write_bytes(b"x")
    blocks = [b for b in doc_blocks() if b.kind == "overrides"]
    assert blocks
    for block in blocks:
        for command in block.commands():
            overrides = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
                         *shlex.split(command, comments=True)]
            load_config(compose_config(overrides, config_name="sead_trainer"), check_paths=False)


def fresh_clone(dest: Path) -> Path:
    """What a clone of this checkout holds (tracked and untracked, not ignored files; mtimes kept so make sees an
    installed .venv as current), with `.venv` linked to this checkout's."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


def _clean_env(clone: Path) -> dict[str, str]:
    """A new user's shell: no virtual environment on PATH and no script settings; the clone's own packages first
    (the linked .venv's editable install points at this checkout)."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not (Path(p).parent / "pyvenv.cfg").exists())
    env["PYTHONPATH"] = str(clone)
    return env


def run_blocks(blocks: list[DocBlock], clone: Path, timeout: int) -> list[str]:
    """Run each block as written in `clone`, `.venv` activated, one shell per block, in order; the failures."""
    failures, env = [], _clean_env(clone)
    for block in blocks:
        if block.language == "python":
            script = clone / f".doc_block_{block.line}.py"
            script.write_text(block.text)
            text = f"python {script.name}\n"
        else:
            text = block.text
        done = subprocess.run(["bash", "-c", "set -eo pipefail\n. .venv/bin/activate\n" + text], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            failures.append(f"{block.where} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return failures


def _runnable(kind: str) -> list[DocBlock]:
    if not (REPO / ".venv" / "bin" / "python").exists() or not (REPO / ".git").exists():
        pytest.skip("needs the checkout's .venv (make install) and its git metadata")
    blocks = [b for b in doc_blocks() if b.kind == kind]
    assert blocks, f"no block is marked {kind}"
    return blocks


@pytest.mark.processes
@pytest.mark.slow
def test_runnable_doc_blocks_run_in_a_fresh_clone(tmp_path):
    blocks = _runnable("run")
    failures = run_blocks(blocks, fresh_clone(tmp_path / "clone"), timeout=300)
    print(f"\nran {len(blocks)} blocks: " + ", ".join(b.where for b in blocks))
    assert not failures, "\n\n".join(failures)


@pytest.mark.extended
@pytest.mark.processes
@pytest.mark.slow
def test_slow_doc_blocks_run_in_a_fresh_clone(tmp_path):
    blocks = _runnable("slow")
    failures = run_blocks(blocks, fresh_clone(tmp_path / "clone"), timeout=1200)
    assert not failures, "\n\n".join(failures)
