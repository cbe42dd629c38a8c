"""A stand-in trainer for the iteration driver's fast tests (the slow test runs the real one).

Called as `python iterate_fake_trainer.py key=value ...` like verl.trainer.main_ppo. It resumes from the latest
checkpoint under trainer.default_local_dir, and for each step up to trainer.total_training_steps appends 4
training dialogues (profiles from controller.pool_path; completed iff cooperation >= 2) to the rollout log and
commits a checkpoint in verl.utils.checkpoint's layout (global_step_N/trainer_state.json, published by a rename,
then the tracker file), without importing torch so that it starts in a blink. Every start is appended to $FAKE_TRAINER_CALLS as JSON;
with FAKE_TRAINER_DIE_AT_STEP=n it SIGKILLs itself after logging step n's dialogues, before its checkpoint.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
root = Path(args["trainer.default_local_dir"])
tracker = root / "latest_checkpointed_iteration.txt"
start = int(tracker.read_text()) if tracker.is_file() else 0
total = int(args["trainer.total_training_steps"])
with open(os.environ["FAKE_TRAINER_CALLS"], "a") as f:
    f.write(json.dumps({"from": start, "to": total, "args": args}) + "\n")
pool = [json.loads(line)["profile"] for line in Path(args["rollout_loop.config.controller.pool_path"]).open()]
die_at = int(os.environ.get("FAKE_TRAINER_DIE_AT_STEP", "0"))
for step in range(start + 1, total + 1):
    with open(args["rollout_loop.config.rollout_log_path"], "a") as log:
        for j in range(4):
            profile = pool[(step * 4 + j) % len(pool)]
            outcome = "completed" if profile["cooperation"] >= 2 else "hung_up"
            log.write(json.dumps({"step": step, "split": "train", "dialogue_id": f"{step}-{j}", "profile": profile,
                                  "outcome": outcome, "turns": [{"agent_stage": 0}]}) + "\n")
    if step == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    partial = root / f"global_step_{step}.partial"
    partial.mkdir(parents=True)
    (partial / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    partial.rename(root / f"global_step_{step}")
    tracker.write_text(str(step))
