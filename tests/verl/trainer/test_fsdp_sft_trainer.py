"""The SFT trainer: the loss is the token mean over a batch's loss-carrying tokens (checked in float64 by hand),
micro-batching and the data order do not change the update, the schedule is the seeded epoch order, bad
settings fail by name, and FSDP2 over 2 gloo ranks (a torchrun launch of the simulator fine-tuning) trains the
same weights as one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llm_agent.user_sim.processes import free_port
from verl.trainer.fsdp_sft_trainer import SFTConfig, SFTRow, batch_schedule, train_sft

REPO = Path(__file__).resolve().parents[3]


def random_rows(vocab: int, n: int = 6, seed: int = 0) -> list[SFTRow]:
    """Rows of random lengths with a random loss mask (position 0 never counts: nothing predicts it)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(5, 14, (1,), generator=gen))
        ids = torch.randint(4, vocab, (length,), generator=gen).tolist()
        mask = (torch.rand(length, generator=gen) < 0.6).long().tolist()
        mask[-1] = 1
        rows.append(SFTRow(ids, mask))
    return rows


def float64_loss(model_path: str, rows: list[SFTRow]) -> float:
    """Weighted token-mean NLL of the rows' loss-carrying tokens under the untrained model, one row at a time in
    float64 (weights: the rows' loss masks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logp = torch.log_softmax(model(input_ids=torch.tensor([row.input_ids])).logits[0], dim=-1)
            for t in range(1, len(row.input_ids)):
                if row.loss_mask[t]:
                    total -= row.loss_mask[t] * float(logp[t - 1, row.input_ids[t]])
                    count += row.loss_mask[t]
    return total / count


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_first_loss_is_the_float64_token_mean_and_micro_batches_do_not_change_the_update(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_path))
    rows = random_rows(vocab)
    config = SFTConfig(steps=3, lr=1e-2, batch_size=4, seed=1)
    whole = train_sft(tiny_model_path, rows, tmp_path / "whole", config)
    split = train_sft(tiny_model_path, rows, tmp_path / "split",
                      SFTConfig(steps=3, lr=1e-2, batch_size=4, micro_batch_size=1, seed=1))
    log = json.loads((whole / "sft_log.json").read_text())
    first_batch = [rows[i] for i in batch_schedule(len(rows), 1, 4, 1)[0]]
    assert log["losses"][0] == pytest.approx(float64_loss(tiny_model_path, first_batch), rel=1e-5)
    assert log["n_rows"] == 6 and log["world_size"] == 1 and log["steps"] == 3
    split_log = json.loads((split / "sft_log.json").read_text())
    # the same gradient (its norm catches any mis-scaled loss; Adam's update would hide one), the same losses, and
    # weights equal up to float rounding amplified by Adam
    assert split_log["grad_norms"] == pytest.approx(log["grad_norms"], rel=1e-4)
    assert split_log["losses"] == pytest.approx(log["losses"], rel=1e-5)
    a, b = weights(whole), weights(split)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-3
    untrained = train_sft(tiny_model_path, rows, tmp_path / "other_seed", SFTConfig(steps=3, lr=1e-2, batch_size=4,
                                                                                   seed=2))
    assert any(not torch.equal(a[k], weights(untrained)[k]) for k in a)  # another data order, another model


def test_weighted_loss_masks_give_the_weighted_token_mean(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    rows = random_rows(len(AutoTokenizer.from_pretrained(tiny_model_path)), n=4, seed=3)
    weighted = [SFTRow(r.input_ids, [m * (3.0 if i % 2 else 1.0) for i, m in enumerate(r.loss_mask)]) for r in rows]
    out = train_sft(tiny_model_path, weighted, tmp_path / "w", SFTConfig(steps=1, lr=1e-3, batch_size=4))
    expected = float64_loss(tiny_model_path, [weighted[i] for i in batch_schedule(4, 1, 4, 0)[0]])
    assert json.loads((out / "sft_log.json").read_text())["losses"][0] == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(float64_loss(tiny_model_path, rows), rel=1e-3)  # the weights mattered


def test_batch_schedule_is_the_seeded_epoch_order():
    batches = batch_schedule(5, 4, 3, seed=7)
    assert [len(b) for b in batches] == [3, 3, 3, 3]
    flat = [i for b in batches for i in b]
    assert sorted(flat[:5]) == [0, 1, 2, 3, 4] and sorted(flat[5:10]) == [0, 1, 2, 3, 4]  # epoch by epoch
    assert batches == batch_schedule(5, 4, 3, seed=7) and batches != batch_schedule(5, 4, 3, seed=8)
    assert batch_schedule(2, 2, 8, seed=0) == [[1, 0], [1, 0]] or all(sorted(b) == [0, 1]
                                                                     for b in batch_schedule(2, 2, 8, seed=0))


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 0}, "steps"), ({"lr": 0.0}, "lr must be > 0"), ({"lr": float("nan")}, "lr must be a finite"),
    ({"batch_size": 0}, "batch_size"), ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"warmup_steps": 11}, "warmup_steps"), ({"lr_schedule": "linear"}, "lr_schedule"),
    ({"param_dtype": "fp16"}, "param_dtype"), ({"export_dtype": "int8"}, "export_dtype"),
    ({"grad_clip": float("inf")}, "grad_clip"), ({"reshard_after_forward": "no"}, "reshard_after_forward"),
])
def test_bad_settings_fail_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFTConfig(**{"steps": 10, "lr": 1e-3, **kwargs})


def test_rows_without_loss_tokens_are_refused(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        train_sft(tiny_model_path, [], tmp_path / "o", SFTConfig(steps=1, lr=1e-3))
    with pytest.raises(ValueError, match="loss-carrying"):
        train_sft(tiny_model_path, [SFTRow([5, 6, 7], [0, 0, 0])], tmp_path / "o", SFTConfig(steps=1, lr=1e-3))


@pytest.mark.extended  # 37 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_two_fsdp_ranks_train_the_same_weights_as_one_process(tiny_model_path, tmp_path):
    args = ["-m", "utils.simulator_sft", "--model", tiny_model_path, "--scripted", "3", "--max-turns", "3",
            "--steps", "3", "--lr", "5e-3", "--batch-size", "4", "--max-length", "4096", "--warmup-steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, *args, "--out", str(tmp_path / "one")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    fsdp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), *args, "--out", str(tmp_path / "two")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    log_one = json.loads((tmp_path / "one" / "sft_log.json").read_text())
    log_two = json.loads((tmp_path / "two" / "sft_log.json").read_text())
    assert log_two["world_size"] == 2 and log_one["world_size"] == 1
    assert log_two["losses"] == pytest.approx(log_one["losses"], rel=1e-5)
    assert log_two["grad_norms"] == pytest.approx(log_one["grad_norms"], rel=1e-4)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert set(one) <= set(two)  # the FSDP export also writes the tied head under its own name
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-3
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "two")  # the FSDP export is a plain HF directory


def run_on_two_ranks(script: str, model: str, out: Path) -> None:
    """Run `script` (argv: the model, `out`) under torchrun on two CPU ranks; fail with its stderr if it fails."""
    path = out / "script.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(path), model, str(out)], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


_LEAVES_GROUP = """
import os
import sys
from pathlib import Path

import torch.distributed as dist

from verl.trainer.fsdp_sft_trainer import SFTConfig, SFTRow, train_sft

model, out = sys.argv[1], Path(sys.argv[2])
rows = [SFTRow([5, 6, 7, 8], [0, 1, 1, 1]), SFTRow([9, 10, 11], [0, 0, 1])]
train_sft(model, rows, out / "model", SFTConfig(steps=1, lr=1e-3, batch_size=2))
rank = int(os.environ["RANK"])
(out / f"rank{rank}.txt").write_text(str(dist.is_initialized()))
"""


@pytest.mark.slow
def test_two_ranks_leave_the_process_group_they_joined(tiny_model_path, tmp_path):
    """Under torchrun, train_sft joins the gloo group and destroys it when done: a group left to the interpreter's
    shutdown lets gloo's threads outlive it (rank processes aborting after the model was saved)."""
    run_on_two_ranks(_LEAVES_GROUP, tiny_model_path, tmp_path)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["False", "False"]
    assert (tmp_path / "model" / "config.json").is_file()


_RESHARD_OR_NOT = """
import sys
from pathlib import Path

import torch.distributed as dist

from verl.trainer.fsdp_sft_trainer import SFTConfig, SFTRow, train_sft

model, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rows = [SFTRow([5, 6, 7, 8, 9], [0, 1, 1, 1, 1]), SFTRow([9, 10, 11], [0, 0, 1]), SFTRow([4, 3, 2, 1], [0, 1, 0, 1]),
        SFTRow([12, 13, 14, 15, 16, 17], [0, 0, 1, 1, 1, 1])]
for keep in (False, True):
    train_sft(model, rows, out / f"keep_{keep}", SFTConfig(steps=3, lr=1e-2, batch_size=4, micro_batch_size=1,
                                                           reshard_after_forward=not keep))
dist.destroy_process_group()
"""


@pytest.mark.extended  # 20 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow  # one torchrun of two 3-step SFTs: ~20 s
def test_keeping_the_gathered_weights_trains_the_same_weights_bit_for_bit(tiny_model_path, tmp_path):
    """reshard_after_forward=False (the CPU recipe's warm start, whose key leaves it out) changes when FSDP2
    gathers the weights, not one bit of the arithmetic."""
    run_on_two_ranks(_RESHARD_OR_NOT, tiny_model_path, tmp_path)
    logs = [json.loads((tmp_path / f"keep_{k}" / "sft_log.json").read_text()) for k in (False, True)]
    assert [log["reshard_after_forward"] for log in logs] == [True, False]
    assert logs[0]["losses"] == logs[1]["losses"] and logs[0]["grad_norms"] == logs[1]["grad_norms"]
    resharded, kept = weights(tmp_path / "keep_False"), weights(tmp_path / "keep_True")
    assert resharded.keys() == kept.keys()
    assert all(torch.equal(resharded[k], kept[k]) for k in resharded)
    base = weights(Path(tiny_model_path))
    assert any(not torch.equal(resharded[k], base[k]) for k in base.keys() & resharded.keys())  # it did train
