"""RayPPOTrainer: driver maths and balancing (fast), and real training runs on the tiny model (slow).

Slow tests: (a) GRPO on the built-in task raises the mean reward; (c) after balancing across 2 FSDP ranks every
row's reward, target and prompt still belong together; (b) a run killed with SIGKILL after a checkpoint (and a
torn half-written next checkpoint) and restarted continues at the next step, across an epoch boundary, and ends
with the same weights and metrics as an uninterrupted run; (d) GAE with critic warm-up, KL and validation.
"""
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.balance import balance_batch, balanced_partitions
from verl.trainer.ppo.metric_utils import format_console_line
from verl.trainer.ppo.plugins import RolloutLoop
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage, compute_response_mask

REPO = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------------------------- fast: maths
def _rows(n=8, prompt=6, resp=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    resp_len = torch.randint(1, resp + 1, (n,), generator=gen)
    prompt_len = torch.randint(1, prompt + 1, (n,), generator=gen)
    attention = torch.zeros(n, prompt + resp, dtype=torch.long)
    for i in range(n):
        attention[i, prompt - prompt_len[i]:prompt + resp_len[i]] = 1
    row_id = torch.arange(n)
    return DataProto.from_dict(
        tensors={"attention_mask": attention, "responses": torch.zeros(n, resp, dtype=torch.long),
                 "row_id": row_id, "token_level_scores": row_id[:, None].float().expand(n, resp).clone()},
        non_tensors={"row_name": np.array([f"row{i}" for i in range(n)], dtype=object)},
    )


def test_balanced_partitions_are_equal_sized_and_even():
    lengths = [100, 1, 1, 1, 50, 50, 2, 99]
    parts = balanced_partitions(lengths, 2)
    assert sorted(sum(parts, [])) == list(range(8)) and [len(p) for p in parts] == [4, 4]
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= 3


def test_balance_batch_moves_every_per_row_field_together():
    data = _rows(n=16, prompt=20, resp=8)
    metrics = balance_batch(data, world_size=4)
    assert metrics["balance/max_tokens_after"] <= metrics["balance/max_tokens_before"]
    order = data.batch["row_id"].tolist()
    assert order != list(range(16)), "expected a reordering"
    for pos, rid in enumerate(order):
        assert data.non_tensor_batch["row_name"][pos] == f"row{rid}"
        assert torch.all(data.batch["token_level_scores"][pos] == rid)


def test_compute_response_mask_is_response_part_of_attention():
    data = _rows()
    assert torch.equal(compute_response_mask(data), data.batch["attention_mask"][:, -4:])


def test_compute_advantage_grpo_groups_rows_by_uid_after_reordering():
    rewards = torch.zeros(6, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 5.0, 3.0, 2.0, 9.0])
    mask = torch.ones(6, 3)
    uid = np.array(["a", "b", "a", "b", "a", "b"], dtype=object)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": uid})
    compute_advantage(data, "grpo", num_repeat=3)
    expected, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index=uid)
    assert torch.allclose(data.batch["advantages"], expected)
    a_scores = torch.tensor([1.0, 5.0, 2.0])
    assert data.batch["advantages"][0, 0].item() == pytest.approx(
        ((1.0 - a_scores.mean()) / (a_scores.std() + 1e-6)).item(), rel=1e-5)


def test_compute_advantage_rloo_and_reinforce_dispatch_through_registry():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    mask = torch.ones(2, 2)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.array(["g", "g"], dtype=object)})
    compute_advantage(data, "rloo")
    assert data.batch["advantages"][:, 0].tolist() == [-2.0, 2.0]
    compute_advantage(data, "reinforce_plus_plus", gamma=1.0)
    assert data.batch["returns"].tolist() == [[1.0, 1.0], [3.0, 3.0]]


def test_apply_kl_penalty_subtracts_beta_times_kl_on_loss_tokens():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    data = DataProto.from_dict(tensors={"old_log_probs": old, "ref_log_prob": ref, "response_mask": mask,
                                        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0]])})
    ctrl = core_algos.FixedKLController(0.1)
    data, metrics = apply_kl_penalty(data, ctrl, "kl")
    assert torch.allclose(data.batch["token_level_rewards"], torch.tensor([[-0.05, 1.0, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.25)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)


def test_console_line_is_compact_and_keeps_the_key_metrics():
    metrics = {"critic/score/mean": 0.41234567, "actor/pg_loss": -0.0123, "actor/entropy": 3.2, "actor/lr": 0.01,
               "actor/grad_norm": 1.5, "actor/pg_clipfrac": 0.25, "perf/tokens_per_s": 1234.5,
               "timing_s/step": 2.0, "val/test_score/repeat_letter": 0.5, "prompt_length/max": 20.0,
               **{f"timing_per_token_ms/phase{i}": 0.1 for i in range(20)}}
    line = format_console_line(3, 20, metrics)
    assert line.startswith("step 3/20 | score 0.4123 | pg_loss -0.0123")
    for part in ("entropy 3.2", "lr 0.01", "grad_norm 1.5", "clipfrac 0.25", "tok/s 1234", "step_s 2",
                 "val mean reward (repeat_letter) 0.5"):
        assert part in line
    assert "timing_per_token_ms" not in line and "prompt_length" not in line and len(line) < 220
    assert "val/repeat_letter" not in line  # a reward, unlabelled beside a rate, read as one


# ----------------------------------------------------------------------------------------- slow: training
CLOSED: list[bool] = []  # is_validation of every EchoRolloutLoop the trainer closed


class EchoRolloutLoop(RolloutLoop):
    """Rollout-loop plug-in for the tests: single-turn generation plus per-row data derived from each row."""

    def __init__(self, tokenizer, engine, config, is_validation):
        self.tokenizer, self.wg, self.config, self.is_validation = tokenizer, engine, config, is_validation
        self.calls = 0

    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """Generate, then attach each row's own response ids and target as per-row non-tensor data."""
        self.calls += 1
        out = self.wg.generate_sequences(DataProto(batch=gen_batch.batch, meta_info=gen_batch.meta_info))
        echo = np.empty(len(out), dtype=object)
        echo[:] = [row.tolist() for row in out.batch["responses"]]
        out.non_tensor_batch["response_ids_echo"] = echo
        out.non_tensor_batch["target_echo"] = gen_batch.non_tensor_batch["target"].copy()
        return out

    def state_dict(self) -> dict:
        """What the trainer checkpoints."""
        return {"calls": self.calls, "tag": self.config["tag"]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.calls = state["calls"]

    def on_train_step_end(self, batch: DataProto, step: int) -> dict:
        """Report whether the scored, balanced batch still carries each row's own per-row data."""
        aligned = all(t == e for t, e in zip(batch.non_tensor_batch["target"], batch.non_tensor_batch["target_echo"]))
        scored = "token_level_scores" in batch.batch.keys() and "advantages" in batch.batch.keys()
        return {"echo/aligned": float(aligned), "echo/scored": float(scored), "echo/step": step}

    def close(self) -> None:
        """Record that the trainer closed the plug-in at shutdown."""
        CLOSED.append(self.is_validation)


def _overrides(model, data_dir, out_dir, steps, workers, lr=1e-2, extra=()):
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data_dir / 'train.parquet'}",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "data.max_response_length=4",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={64 // workers}",
        f"actor_rollout_ref.actor.optim.lr={lr}", f"trainer.total_training_steps={steps}",
        f"trainer.n_gpus_per_node={workers}", "trainer.device=cpu", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out_dir / 'ckpt'}", f"trainer.log_dir={out_dir / 'logs'}",
        "trainer.val_before_train=false", *extra,
    ]


def _read_metrics(log_dir: Path) -> dict[int, dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line) for line in lines}


@pytest.fixture()
def task_data(tmp_path):
    from verl.tasks.repeat_letter import make_dataset

    make_dataset(tmp_path / "data", train_size=128, val_size=16, seed=0)
    return tmp_path / "data"


@pytest.mark.extended  # 27 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_grpo_learns_builtin_task_and_balanced_rows_stay_aligned(tiny_model_path, task_data, tmp_path,
                                                                  ray_cluster):
    from verl.single_controller.ray import RayResourcePool
    from verl.tasks.repeat_letter import compute_reward
    from verl.trainer.config_schema import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    steps = 8
    loop = "rollout_loop.path=tests.verl.trainer.test_ray_trainer.EchoRolloutLoop"
    config = compose_config(_overrides(tiny_model_path, task_data, tmp_path, steps, workers=2, lr=2e-2,
                                       extra=["trainer.balance_batch=true", "trainer.resume_mode=disable", loop,
                                              "+rollout_loop.config.tag=echo", f"trainer.save_freq={steps}"]))
    tokenizer = load_tokenizer(tiny_model_path)
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    trainer = RayPPOTrainer(config, tokenizer, {Role.ActorRollout: ActorRolloutRefWorker}, pool)
    try:
        trainer.init_workers()
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()

    metrics = _read_metrics(tmp_path / "logs")
    assert all(metrics[s]["echo/aligned"] == 1.0 and metrics[s]["echo/scored"] == 1.0 for s in metrics)
    assert [metrics[s]["echo/step"] for s in sorted(metrics)] == list(range(1, steps + 1))
    plugin_module = importlib.import_module(loop.split("=", 1)[1].rsplit(".", 1)[0])  # the instance the trainer used
    assert sorted(plugin_module.CLOSED) == [False, True], "shutdown must close both rollout-loop plug-ins"

    # (a) the mean sequence score rises by a clear margin
    assert sorted(metrics) == list(range(1, steps + 1))
    score = [metrics[s]["critic/score/mean"] for s in range(1, steps + 1)]
    first, last = float(np.mean(score[:3])), float(np.mean(score[-3:]))
    assert last > first + 0.1, f"mean reward did not rise: {score}"

    # (c) balancing reordered the rows, and each row's data still belongs to it
    batch = trainer.last_batch
    assert "balance/max_tokens_after" in metrics[steps]
    uids = list(batch.non_tensor_batch["uid"])
    prompt_index = [int(u.rsplit("_", 1)[1]) for u in uids]
    assert prompt_index != sorted(prompt_index), "balancing did not reorder the rows"
    prompt_text = tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
    for row, (target, text, uid) in enumerate(zip(batch.non_tensor_batch["target"], prompt_text, uids)):
        content = batch.non_tensor_batch["raw_prompt"][row][0]["content"]
        assert content in text, f"row {row}: prompt tokens {text!r} are not its messages {content!r}"
        assert content.rstrip(".")[-1] == target, f"row {row}: target {target!r} does not match {content!r}"
        same = [i for i, u in enumerate(uids) if u == uid]
        assert len(same) == 8 and all(torch.equal(batch.batch["prompts"][i], batch.batch["prompts"][row]) for i in same)
    rescored, _ = compute_reward(batch, tokenizer)
    assert torch.equal(rescored, batch.batch["token_level_scores"])
    for row in range(len(batch)):  # per-row data the rollout loop returned followed its row through the reorder
        assert batch.non_tensor_batch["response_ids_echo"][row] == batch.batch["responses"][row].tolist()
        assert batch.non_tensor_batch["target_echo"][row] == batch.non_tensor_batch["target"][row]
    state = json.loads((tmp_path / "ckpt" / f"global_step_{steps}" / "trainer_state.json").read_text())
    assert state["rollout_loop"] == {"calls": steps, "tag": "echo"}
    assert state["global_step"] == steps


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
                RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")


def _launch(args, log_path: Path) -> subprocess.Popen:
    """Start ``python -m verl.trainer.main_ppo`` in its own session (so SIGKILL reaches its Ray processes too)."""
    cwd = log_path.parent / "cwd"
    cwd.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *args], cwd=cwd, env=_env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.processes
def test_cli_reports_config_errors_by_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "data.train_batch_size=7"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "config error: actor_rollout_ref.model.path is required" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "+trainer.save_every=3"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert "config error: trainer.save_every is not a config key" in proc.stderr
    assert list(tmp_path.iterdir()) == [], "Hydra must not create outputs/ or .hydra/ in the working directory"


def _wait(proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"training run timed out; log:\n{log_path.read_text()[-3000:]}")
    assert rc == 0, f"training run failed (rc={rc}); log:\n{log_path.read_text()[-3000:]}"


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "actor" / "model.safetensors"))


@pytest.mark.extended  # 69 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tiny_model_path, tmp_path):
    from verl.tasks.repeat_letter import make_dataset
    from verl.utils.checkpoint import find_latest_checkpoint, step_of

    steps = 4
    small = tmp_path / "small_data"  # 24 prompts = 3 batches per epoch: the resumed run crosses an epoch boundary
    make_dataset(small, train_size=24, val_size=8, seed=1)
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    common = ["trainer.save_freq=1", "trainer.resume_mode=auto", "trainer.max_ckpt_to_keep=3"]
    reference = _launch(_overrides(tiny_model_path, small, ref_dir, steps, workers=1, extra=common),
                        tmp_path / "reference.log")
    victim = _launch(_overrides(tiny_model_path, small, run_dir, steps, workers=1, extra=common),
                     tmp_path / "victim.log")
    deadline = time.monotonic() + 240
    try:  # SIGKILL while the checkpoint of step 3 is being written
        while not (run_dir / "ckpt" / "global_step_3.partial").is_dir():
            assert victim.poll() is None, f"run ended before its checkpoint:\n{(tmp_path / 'victim.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.02)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
    _wait(reference, tmp_path / "reference.log", 240)
    resumed_from = step_of(find_latest_checkpoint(run_dir / "ckpt"))
    assert resumed_from in (2, 3), "the kill came during the save of step 3 (or just after its commit rename)"
    # what a kill during a save leaves: a half-written global_step_N.partial (torn weights and state), ignored
    torn = run_dir / "ckpt" / f"global_step_{resumed_from + 1}.partial"
    (torn / "actor").mkdir(parents=True, exist_ok=True)
    (torn / "actor" / "model.safetensors").write_bytes(b"\x00torn")
    (torn / "trainer_state.json").write_text('{"global_step": %d, "datal' % (resumed_from + 1))

    restart = _overrides(tiny_model_path, small, run_dir, steps, workers=1, extra=common)
    restart = [a for a in restart if not a.startswith("trainer.log_dir=")] + [f"trainer.log_dir={run_dir / 'logs2'}"]
    resumed = _launch(restart, tmp_path / "resumed.log")
    _wait(resumed, tmp_path / "resumed.log", 240)

    ref_metrics, new_metrics = _read_metrics(ref_dir / "logs"), _read_metrics(run_dir / "logs2")
    assert sorted(new_metrics) == list(range(resumed_from + 1, steps + 1)), "a step was repeated or skipped"
    assert f"resumed from {run_dir / 'ckpt' / f'global_step_{resumed_from}'} at step {resumed_from}" in (
        tmp_path / "resumed.log").read_text()
    assert new_metrics[steps]["training/epoch"] == ref_metrics[steps]["training/epoch"] == 1
    for step in new_metrics:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean",
                    "prompt_length/mean"):
            assert new_metrics[step][key] == pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-6), (step, key)
    ref_state = json.loads((ref_dir / "ckpt" / f"global_step_{steps}" / "trainer_state.json").read_text())
    new_state = json.loads((run_dir / "ckpt" / f"global_step_{steps}" / "trainer_state.json").read_text())
    assert new_state["dataloader"] == ref_state["dataloader"]
    ref_w, new_w = _weights(ref_dir / "ckpt" / f"global_step_{steps}"), _weights(run_dir / "ckpt" / f"global_step_{steps}")
    assert ref_w.keys() == new_w.keys()
    for name in ref_w:
        assert torch.allclose(ref_w[name], new_w[name], atol=1e-6, rtol=0), name
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir() if p.name.startswith("global_step_")) == [
        "global_step_2", "global_step_3", "global_step_4"]
    assert list((tmp_path / "cwd").iterdir()) == [], "the run littered its working directory"


@pytest.mark.slow
def test_gae_run_trains_critic_uses_reference_kl_validates_and_saves(tiny_model_path, task_data, tmp_path,
                                                                     ray_cluster, caplog):
    from transformers import AutoModelForCausalLM

    from verl.trainer.config_schema import compose_config
    from verl.trainer.main_ppo import run_ppo

    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_path}", f"data.train_files={task_data / 'train.parquet'}",
        f"data.val_files={task_data / 'val.parquet'}", "data.max_response_length=4", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.use_kl_loss=true", "trainer.critic_warmup=1", "trainer.total_training_steps=2",
        "trainer.test_freq=2", "trainer.save_freq=1", "trainer.save_hf_model=last", "trainer.logger=[jsonl,console]",
        "trainer.device=cpu",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'logs'}",
    ]
    with caplog.at_level(logging.INFO, logger="verl.trainer.console"):
        last = run_ppo(compose_config(overrides))
    lines = [r.getMessage() for r in caplog.records if r.name == "verl.trainer.console"]
    assert [line.split(" |")[0] for line in lines] == ["step 0/2", "step 1/2", "step 2/2"], lines
    assert " | vf_loss " in lines[1] and " | pg_loss " in lines[2] and "val mean reward (repeat_letter)" in lines[2]
    metrics = _read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [0, 1, 2]
    assert "val/test_score/repeat_letter" in metrics[0] and "val/test_score/repeat_letter" in last
    assert "critic/vf_loss" in metrics[1] and "actor/pg_loss" not in metrics[1], "critic_warmup=1: critic only"
    assert "actor/pg_loss" in metrics[2] and "actor/kl_loss" in metrics[2] and "critic/values/mean" in metrics[2]
    assert metrics[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
    assert metrics[2]["actor/reward_kl_penalty_coeff"] < 0.001, "adaptive controller: KL below target lowers beta"
    first = tmp_path / "ckpt" / "global_step_1"  # save_hf_model=last: resume state only, then the export
    assert (first / "actor" / "sharded_state").is_dir() and not (first / "actor" / "model.safetensors").exists()
    assert not (first / "critic" / "model.safetensors").exists()
    ckpt = tmp_path / "ckpt" / "global_step_2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["actor", "checkpoint_manifest.json", "critic", "trainer_config.json", "trainer_state.json"]
    from verl.utils.run_config import load_run_config

    assert load_run_config(ckpt).select("algorithm.adv_estimator") == "gae"  # the run's own config, kept with it
    model = AutoModelForCausalLM.from_pretrained(ckpt / "actor")
    assert model.num_parameters() > 0
