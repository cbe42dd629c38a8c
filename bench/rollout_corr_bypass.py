"""Benchmark: what rollout correction costs and what its bypass mode saves, on real trainer steps.

    python -m bench.rollout_corr_bypass [--steps 4] [--repeats 2] [--prompts 8] [--n 4] [--response-length 96]
                                        [--hidden 256] [--layers 4] [--out bench/results/rollout_corr_bypass.json]

Trainer steps: RayPPOTrainer (Ray, one FSDP2 worker on gloo, HF rollout with ``calculate_log_probs``) trains a
small random Qwen2 (``utils/make_tiny_model.py`` with ``--hidden``/``--layers``) with GRPO on the built-in task,
``--prompts`` x ``--n`` rows per step, in three set-ups, one after the other and ``--repeats`` times in turn:
``plain`` (no rollout log-probs, no correction), ``decoupled`` (token-level TIS and token_k3 rejection after the
old-log-prob pass) and ``bypass`` (``bypass_mode``: the rollout's log-probs are the old ones, no old-log-prob
pass, the PPO-clip bypass loss). Per set-up: the median over the steps after the first of each run of the
step time and its phases (``timing_s/*``); the saving of bypass mode is the step time decoupled - bypass beside
the old-log-prob pass it removes.

In process (CPU time, which other processes on a shared box disturb far less than wall time): one actor
(``DataParallelPPOActor`` on the same model, no Ray) on a batch of the same shape: the old-log-prob pass
(``compute_log_prob``) beside what bypass mode adds to the update (``update_policy`` with the ``bypass_mode`` loss
minus with the vanilla loss), medians of ``--repeats`` x 3 runs.

Driver side: :func:`verl.trainer.ppo.trainer_rollout_corr.correct_batch` (per-turn mismatch, turn-level IS
weights, token and turn rejection, all metrics) on a GPU-preset-sized batch (``--driver-rows`` dialogues of
``--driver-length`` response tokens in 15 agent turns), median of 3 calls.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from bench.results import write_result
from utils.make_tiny_model import TinyModelSpec, build_tiny_model
from verl.protocol import DataProto
from verl.single_controller.ray import RayResourcePool
from verl.tasks.repeat_letter import make_dataset
from verl.trainer.config_schema import RolloutCorrectionConfig, compose_config
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
from verl.trainer.ppo.trainer_rollout_corr import correct_batch
from verl.utils.dataset import load_tokenizer
from verl.workers.fsdp_workers import ActorRolloutRefWorker

logger = logging.getLogger("bench.rollout_corr_bypass")

KEY = "algorithm.rollout_correction"
SETUPS = {
    "plain": [],
    "decoupled": ["actor_rollout_ref.rollout.calculate_log_probs=true", f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold=2.0", f"{KEY}.rollout_rs=token_k3",
                  f"{KEY}.rollout_rs_threshold=1.0"],
    "bypass": ["actor_rollout_ref.rollout.calculate_log_probs=true", f"{KEY}.bypass_mode=true", f"{KEY}.rollout_rs=token_k3", f"{KEY}.rollout_rs_threshold=1.0"],
}
PHASES = ("step", "gen", "old_log_prob", "adv", "update_actor")


def _overrides(args: argparse.Namespace, model: Path, data: Path, out: Path, setup: str) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
            "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={args.n}",
            f"data.max_response_length={args.response_length}", f"data.train_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-5", f"trainer.total_training_steps={args.steps}",
            "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'logs'}",
            "trainer.val_before_train=false", "trainer.resume_mode=disable", "trainer.balance_batch=false",
            *SETUPS[setup]]


def _run(args: argparse.Namespace, model: Path, data: Path, out: Path, setup: str) -> list[dict]:
    """Train ``args.steps`` steps in ``setup``; the logged metrics of every step."""
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    config = compose_config(_overrides(args, model, data, out, setup))
    trainer = RayPPOTrainer(config, load_tokenizer(str(model)), {Role.ActorRollout: ActorRolloutRefWorker}, pool)
    try:
        trainer.init_workers()
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def _actor_batch(rows: int, prompt_length: int, response_length: int, vocab: int) -> DataProto:
    """Unpadded random prompts and responses with advantages (the shape of a trainer step's batch)."""
    gen = torch.Generator().manual_seed(0)
    length = prompt_length + response_length
    input_ids = torch.randint(4, vocab, (rows, length), generator=gen)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "responses": input_ids[:, prompt_length:],
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "position_ids": torch.arange(length).expand(rows, length).clone(),
        "response_mask": torch.ones(rows, response_length, dtype=torch.long),
        "advantages": torch.randn(rows, response_length, generator=gen)},
        meta_info={"micro_batch_size": 8, "temperature": 1.0})


def bench_actor(args: argparse.Namespace, model: Path) -> dict:
    """CPU seconds of the old-log-prob pass and of one update with the vanilla and the bypass-mode loss."""
    import copy

    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from verl.utils.optim import build_optimizer
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    batch = _actor_batch(args.prompts * args.n, 24, args.response_length, base.config.vocab_size)
    corr = {"rollout_is": None, "rollout_rs": "token_k3", "rollout_rs_threshold": 1.0, "loss_type": "ppo_clip"}
    cfg = {"ppo_mini_batch_size": args.prompts * args.n, "ppo_micro_batch_size_per_gpu": 8, "ppo_epochs": 1,
           "clip_ratio": 0.2, "loss_agg_mode": "token-mean", "grad_clip": 1.0,
           "optim": {"lr": 1e-5, "weight_decay": 0.0, "betas": [0.9, 0.999], "total_training_steps": 10}}
    times: dict[str, list[float]] = {"old_log_prob": [], "update_vanilla": [], "update_bypass": []}
    for _ in range(args.repeats * 3):
        for name, policy_loss in (("update_vanilla", None), ("update_bypass", {"loss_mode": "bypass_mode",
                                                                             "rollout_correction": corr})):
            conf = OmegaConf.create({**cfg, **({"policy_loss": policy_loss} if policy_loss else {})})
            module = copy.deepcopy(base)
            actor = DataParallelPPOActor(conf, module, build_optimizer(module.parameters(), conf.optim))
            start = time.process_time()
            log_probs, _ = actor.compute_log_prob(batch, calculate_entropy=True)
            if name == "update_vanilla":
                times["old_log_prob"].append(time.process_time() - start)
            data = copy.deepcopy(batch)
            data.batch["old_log_probs"] = log_probs + 0.05 * torch.randn_like(log_probs)
            start = time.process_time()
            actor.update_policy(data)
            times[name].append(time.process_time() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    added = medians["update_bypass"] - medians["update_vanilla"]
    return {"rows": args.prompts * args.n, "tokens_per_row": 24 + args.response_length, "median_cpu_s": medians,
            "bypass_loss_added_cpu_s": added, "net_saving_cpu_s": medians["old_log_prob"] - added,
            "net_saving_fraction_of_logprob_plus_update": (medians["old_log_prob"] - added)
            / (medians["old_log_prob"] + medians["update_vanilla"]), "times_cpu_s": times}


def _driver_batch(rows: int, length: int, turns: int = 15) -> DataProto:
    """Dialogue-shaped tensors: ``turns`` agent turns per row, user turns (mask 0) between them."""
    gen = torch.Generator().manual_seed(0)
    period = length // turns
    agent = (torch.arange(length) % period) < (period * 2) // 3
    mask = agent.float().expand(rows, length).clone()
    old = -torch.rand(rows, length, generator=gen) * 3
    rollout = old + torch.randn(rows, length, generator=gen) * 0.05
    return DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})


def bench_driver(rows: int, length: int) -> dict:
    """Median seconds of ``correct_batch`` (turn IS + token and turn rejection) over 3 calls."""
    config = RolloutCorrectionConfig(rollout_is="turn", rollout_is_threshold=2.0, rollout_rs="token_k1,turn_mean_k3",
                                     rollout_rs_threshold="0.5_2.0,0.01")
    times = []
    for _ in range(3):
        batch = _driver_batch(rows, length)
        start = time.perf_counter()
        correct_batch(batch, config)
        times.append(time.perf_counter() - start)
    return {"rows": rows, "response_length": length, "turns": 15, "median_s": statistics.median(times),
            "times_s": times}


def bench_trainer(args: argparse.Namespace, model: Path, data: Path, out: Path) -> dict:
    """Median phase times per set-up over the steps after the first of each run."""
    per_setup: dict[str, list[dict]] = {name: [] for name in SETUPS}
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        for repeat in range(args.repeats):
            for setup in SETUPS:
                per_setup[setup].extend(_run(args, model, data, out / f"{setup}_{repeat}", setup)[1:])
    finally:
        ray.shutdown()
    table = {}
    for setup, steps in per_setup.items():
        table[setup] = {phase: statistics.median(s[f"timing_s/{phase}"] for s in steps)
                        for phase in PHASES if all(f"timing_s/{phase}" in s for s in steps)}
        table[setup]["train_s"] = statistics.median(s["timing_s/step"] - s["timing_s/gen"] for s in steps)
        table[setup]["steps"] = len(steps)
    return table


def main() -> None:
    """Run the set-ups, print the tables and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--driver-rows", type=int, default=480)
    parser.add_argument("--driver-length", type=int, default=6144)
    parser.add_argument("--out", type=Path, default=Path("bench/results/rollout_corr_bypass.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    load_at_start = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        model = build_tiny_model(tmp_dir / "model", seed=0, spec=spec)
        make_dataset(tmp_dir / "data", train_size=args.prompts * args.steps, val_size=4, seed=0)
        table = bench_trainer(args, model, tmp_dir / "data", tmp_dir)
        actor = bench_actor(args, model)
    driver = bench_driver(args.driver_rows, args.driver_length)
    dec, byp = table["decoupled"], table["bypass"]
    summary = {"step_saving_s": dec["step"] - byp["step"], "train_saving_s": dec["train_s"] - byp["train_s"],
               "old_log_prob_s": dec["old_log_prob"], "bypass_over_decoupled_train": byp["train_s"] / dec["train_s"]}
    columns = PHASES + ("train_s",)
    print(f"trainer steps, wall s (median of {dec['steps']} steps; train_s = step - gen)")
    print(f"{'set-up':10s} " + " ".join(f"{p:>13s}" for p in columns))
    for setup, row in table.items():
        print(f"{setup:10s} " + " ".join(f"{row.get(p, float('nan')):13.3f}" for p in columns))
    print(f"bypass saves {summary['train_saving_s']:.3f} s of training per step ({summary['step_saving_s']:.3f} s "
          f"of the whole step); the old-log-prob pass it removes took {summary['old_log_prob_s']:.3f} s; "
          f"bypass/decoupled training time {summary['bypass_over_decoupled_train']:.3f}")
    cpu = actor["median_cpu_s"]
    print(f"in process, CPU s: old-log-prob pass {cpu['old_log_prob']:.3f}, update vanilla {cpu['update_vanilla']:.3f}, "
          f"update bypass {cpu['update_bypass']:.3f}: bypass adds {actor['bypass_loss_added_cpu_s']:.3f} and saves "
          f"{actor['net_saving_cpu_s']:.3f} net ({100 * actor['net_saving_fraction_of_logprob_plus_update']:.1f}% of "
          "old-log-prob + update)")
    print(f"driver-side correct_batch on {driver['rows']} x {driver['response_length']} tokens (15 turns): "
          f"{driver['median_s']:.3f} s")
    write_result(args, load_at_start, {"torch_threads": torch.get_num_threads(), "torch": torch.__version__},
                 setups=table, summary=summary, actor=actor, driver=driver)


if __name__ == "__main__":
    main()
