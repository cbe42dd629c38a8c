"""Test helper: a trainer checkpoint of a model written by the real actor worker, in a child process.

`write_checkpoint(model, root, step, hf_export)` runs this module (`python -m`): an `ActorRolloutRefWorker` (FSDP2
on a 1-rank gloo group) loads `model` and saves its actor state into `root/global_step_<step>/actor/` through the
trainer's checkpoint protocol (`.partial` directory, trainer_state.json, commit and tracker file). With
`hf_export=False` the checkpoint holds only `sharded_state/`, config and tokenizer, as the GPU preset's
intermediate checkpoints do (`trainer.save_hf_model=last`). A child process keeps the worker's process group out
of the test process (a vLLM engine needs its own).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.repo import REPO, SCENARIO_PATH
from verl.utils.checkpoint import save_trainer_state
from verl.utils.run_config import save_run_config


def write_checkpoint(model_path: str, root: Path, step: int = 1, hf_export: bool = False) -> Path:
    """Write the checkpoint (see the module docstring); returns `root/global_step_<step>`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.checkpoint_fixtures", model_path, str(root), str(step), str(int(hf_export))],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"writing the checkpoint failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return root / f"global_step_{step}"


def fake_checkpoint(root, step, config=None, cwd="/the/run"):
    """A committed `global_step_<step>` with an actor/ export marker, its trainer state and (optionally) config."""
    step_dir = root / f"global_step_{step}"
    (step_dir / "actor").mkdir(parents=True)
    (step_dir / "actor" / "config.json").write_text("{}")
    save_trainer_state(step_dir, {"global_step": step})
    if config is not None:
        save_run_config(step_dir, config, cwd=cwd)
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return step_dir


def demo_config(max_turns=10, val_files="outputs/prompt_data/demo/test.parquet"):
    """A demo-like training config (the settings an evaluation takes from a checkpoint)."""
    return {"data": {"val_files": val_files, "max_prompt_length": 96},
            "rollout_loop": {"config": {"scenario": str(SCENARIO_PATH), "max_turns": max_turns,
                                        "max_tokens_per_turn": 64, "max_response_length": 768, "max_user_tokens": 48,
                                        "seed": 3, "user_sim": {"temperature": 0.5, "top_p": 0.9, "max_tokens": 200,
                                                                "timeout_s": 30.0, "max_attempts": 2}}}}


def _main(model_path: str, root: str, step: int, hf_export: bool) -> None:
    import torch.distributed as dist

    from tests.helpers.ppo_batch_helpers import actor_rollout_ref_config
    from verl.utils.checkpoint import begin_checkpoint, commit_checkpoint, save_trainer_state
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(actor_rollout_ref_config(model_path), role="actor_rollout_ref")
    worker.init_model()
    partial = begin_checkpoint(root, step)
    worker.save_checkpoint(str(partial / "actor"), global_step=step, save_hf_model=hf_export)
    save_trainer_state(partial, {"global_step": step})
    commit_checkpoint(root, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
