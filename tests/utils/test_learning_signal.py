"""A run that cannot learn says so: utils.learning_signal reads the tracked metrics of a run and warns when no
training step had a non-zero advantage (the GPU preset's rehearsal once trained 2 steps on dialogues that all timed
out, pg_loss 0, without a word); the trainer's per-step metric it reads is the share of loss tokens whose advantage
is not 0."""
from __future__ import annotations

import json

import numpy as np
import torch

from utils.learning_signal import main, signal_report, training_steps
from verl.protocol import DataProto
from verl.trainer.ppo.metric_utils import compute_data_metrics

TIMED_OUT = {"dialogue/completion_rate": 0.0, "dialogue/hang_up_rate": 0.0, "dialogue/timeout_rate": 1.0}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn": ')


def test_no_signal_in_any_step_is_a_warning_naming_the_outcome(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"step": 0, "val/dialogue/completion_rate": 0.0},
                     *({"step": s, "critic/advantages/nonzero_frac": 0.0, **TIMED_OUT} for s in (1, 2))])
    assert main([str(metrics)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("WARNING: this run could not learn: none of its 2 training steps had a non-zero advantage")
    assert ("every training dialogue timed out (rollout_loop.config.max_turns reached): raise "
            "rollout_loop.config.max_turns so that a call can end") in out


def test_some_or_all_steps_with_a_signal(tmp_path, capsys):
    mixed = [{"step": 1, "critic/advantages/nonzero_frac": 0.0}, {"step": 2, "critic/advantages/nonzero_frac": 0.4}]
    assert signal_report(mixed) == ("note: 1 of 2 training steps had no learning signal (every advantage 0: the "
                                    "samples of each prompt group got equal rewards)")
    assert signal_report([{"critic/advantages/nonzero_frac": 0.7}]) is None and signal_report([]) is None
    # the rehearsal's outcome mix: hang-ups and timeouts, no completion
    ended = [{"critic/advantages/nonzero_frac": 0.0, "dialogue/completion_rate": 0.0, "dialogue/hang_up_rate": h,
              "dialogue/timeout_rate": 1.0 - h} for h in (0.75, 0.25)]
    assert signal_report(ended).endswith("no training dialogue completed (each hung up, gave up or timed out): "
                                         "start from a model that completes calls sometimes, or allow longer calls "
                                         "(rollout_loop.config.max_turns)")
    # logs from before the fraction was logged: the advantages' max and min
    older = tmp_path / "older.jsonl"
    _write(older, [{"step": 1, "critic/advantages/max": 0.0, "critic/advantages/min": 0.0, **TIMED_OUT}])
    assert len(training_steps(older)) == 1 and signal_report(training_steps(older)).startswith("WARNING")
    assert main([str(tmp_path / "missing.jsonl")]) == 1 and "cannot read" in capsys.readouterr().err


def test_the_step_metrics_count_loss_tokens_with_a_non_zero_advantage():
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]])
    advantages = torch.tensor([[0.5, 0.5, 9.0, 0.5], [9.0, 0.0, 0.0, 0.0]])
    batch = DataProto.from_dict(tensors={
        "response_mask": mask, "advantages": advantages, "returns": advantages,
        "token_level_scores": torch.zeros(2, 4), "token_level_rewards": torch.zeros(2, 4),
        "responses": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 7, dtype=torch.long)},
        non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    assert compute_data_metrics(batch, use_critic=False)["critic/advantages/nonzero_frac"] == 3 / 6
    batch.batch["advantages"] = torch.where(mask.bool(), 0.0, 7.0)  # non-zero only off the loss tokens
    assert compute_data_metrics(batch, use_critic=False)["critic/advantages/nonzero_frac"] == 0.0
