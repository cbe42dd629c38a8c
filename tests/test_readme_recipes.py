"""README's evaluation recipe, run as written: the commands of its "After `make demo`" block, in a directory laid
out as `make demo` leaves it (a checkpoint with the CPU demo's training config, the prompt data it names), each
command's own `main` on the README's arguments (in-process: the interpreter and torch start once; the scripted
simulators evaluate.py starts are real processes)."""
from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil

import pytest

from utils.create_prompt_data import create_prompt_data
from verl.utils.checkpoint import save_trainer_state
from verl.utils.run_config import save_run_config

from tests.helpers.repo import COMPACT_SYSTEM_PROMPT, REPO, SCENARIO_PATH

# the CPU demo's settings (scripts/presets.sh, scripts/main.sh): the README's command must not override them
DEMO_MAX_TURNS = 10
DEMO_LOOP = {"max_turns": DEMO_MAX_TURNS, "max_tokens_per_turn": 64, "max_response_length": 768, "max_user_tokens": 48,
             "seed": 0}
DEMO_MAX_PROMPT_LENGTH = 96  # its compact agent prompt


def recipe_commands(readme: str) -> list[str]:
    """The commands of the bash block after "After `make demo`" in the evaluation section, continuations joined."""
    section = readme.split("## Evaluating and comparing agents", 1)[1]
    block = re.search(r"After `make demo`.*?```bash\n(.*?)```", section, re.S)
    assert block, "README: no 'After `make demo`' bash block in the evaluation section"
    text = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


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
    commands = [shlex.split(c) for c in recipe_commands((REPO / "README.md").read_text(encoding="utf-8"))]
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
