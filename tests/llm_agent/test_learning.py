"""Learning: GRPO with the real trainer, the SEAD rollout loop and two scripted simulator servers raises the
dialogue reward of a warm-started tiny model (seeded; about 2.5 minutes on 2 CPU cores).

A random-weight tiny model never writes a well-formed agent turn, so it is first fine-tuned
(utils/sft_warm_start.py) on scripted calls of mixed quality: SOP-following ("good"), pushy ("bad") and
untagged ("malformed"). Its sampled turns then vary, which is what group-relative advantages need. The
scenario, the simulator servers, the loop, the reward and the trainer are the real ones; to fit a CPU budget the
prompt is a compact system prompt (the scenario's own is ~1300 tokens) and calls last at most 3 agent turns.

What the tiny model can learn here: the agent tag protocol (the `format` component) and not claiming success
it did not get (`false_positive`) while keeping its state estimates (`profile_accuracy`). It does not complete
calls (completion needs 5+ coherent turns), so completion stays 0 and the assertion is on the mean reward plus
the format-error rate. Per-sequence loss averaging (seq-mean-token-mean) and a small lr matter: with token-mean,
long failed calls dominate the update and the policy drifts into malformed output; at lr >= 1e-3 the SFT
model's fragile format falls apart within a few steps. Check robustness with SEAD_LEARNING_SEED=1, 2, ...
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH

REPO = Path(__file__).resolve().parents[2]
SCENARIO = DEFAULT_SCENARIO_PATH
SYSTEM_PROMPT = ("You are Mia from FoodLoop's merchant growth team. Phone the restaurant manager, get them to "
                 "claim the free trial credit in the app, and answer in the tags.")
QUALITY_MIX = {"good": 0.4, "bad": 0.1, "malformed": 0.5}
WEIGHTS = {"completion": 10.0, "format": 4.0, "profile_accuracy": 1.0, "false_positive": 2.0}
MAX_TURNS = 3
SFT_DIALOGUES, SFT_STEPS, SFT_LR = 64, 150, 1e-2
GRPO_STEPS, GRPO_LR = 20, 5e-4
PROMPTS_PER_STEP, GROUP_SIZE = 4, 8
MARGIN = 0.4  # rise of the mean reward, last 4 steps over the first 4
SEED = int(os.environ.get("SEAD_LEARNING_SEED", "0"))  # robustness checks: run with other seeds


@pytest.fixture()
def sim_urls(tmp_path):
    from tests.helpers.sim_servers import SimServers

    servers = SimServers(tmp_path)
    urls = [servers.start("--scenario", str(SCENARIO), "--seed", str(seed)) for seed in (1, 2)]
    try:
        servers.wait_ready(*urls)
        yield urls
    finally:
        servers.stop_all()


def _prompt_data(out_dir: Path, n: int, seed: int) -> Path:
    """Train prompts: the compact system prompt, the scenario's opening and a seeded user profile per row."""
    from llm_agent.scenario import load_scenario
    from utils.create_prompt_data import prompt_rows, random_profiles, write_rows

    scenario = load_scenario(SCENARIO)
    rows = prompt_rows(scenario, random_profiles(scenario, n, seed), "train")
    for row in rows:
        row["prompt"] = [{"role": "system", "content": SYSTEM_PROMPT}, dict(row["prompt"][1])]
    return write_rows(rows, out_dir / "train.parquet")


def _overrides(model: Path, train: Path, out: Path, urls: list[str]) -> list[str]:
    loop = "rollout_loop.config"
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={train}",
        "data.max_prompt_length=96", "data.max_response_length=512", f"data.train_batch_size={PROMPTS_PER_STEP}",
        f"actor_rollout_ref.rollout.n={GROUP_SIZE}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", f"actor_rollout_ref.actor.optim.lr={GRPO_LR}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        f"trainer.total_training_steps={GRPO_STEPS}", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'logs'}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", f"trainer.seed={SEED}", f"data.seed={SEED}",
        f"actor_rollout_ref.actor.seed={SEED}", f"{loop}.seed={SEED}", f"{loop}.scenario={SCENARIO}",
        f"{loop}.max_turns={MAX_TURNS}",
        f"{loop}.max_tokens_per_turn=120", f"{loop}.max_user_tokens=64", f"{loop}.user_sim.urls='{','.join(urls)}'",
        f"{loop}.user_sim.temperature=1.0", f"{loop}.cache.enabled=false", f"{loop}.controller.enabled=false",
        f"{loop}.rollout_log_path={out / 'rollouts.jsonl'}", f"{loop}.val_metrics_path=null",
        *(f"reward.kwargs.weights.{name}={w}" for name, w in WEIGHTS.items()),
    ]


def _check_rows_carry_their_own_dialogue(batch, tokenizer) -> None:
    """Every trained row's loss tokens are its own record's agent turns, and its reward sits on its last one."""
    mask = batch.batch["response_mask"]
    for row in range(len(batch)):
        turns, reward = batch.non_tensor_batch["turns"][row], batch.non_tensor_batch["reward"][row]
        ids = batch.batch["responses"][row][mask[row].bool()].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        agent_texts = [t["agent_text"] for t in turns]
        assert "".join(agent_texts).replace(" ", "") == text.replace(" ", ""), (row, agent_texts, text)
        scores = batch.batch["token_level_scores"][row]
        last = int(mask[row].nonzero().max())
        assert scores[last].item() == pytest.approx(reward, abs=1e-5)
        assert scores.abs().sum().item() == pytest.approx(abs(reward), abs=1e-5), "one scalar per row"


@pytest.mark.slow
def test_grpo_raises_dialogue_reward_of_warm_started_tiny_model(tiny_model_path, tmp_path, sim_urls, ray_cluster):
    from utils.sft_warm_start import scripted_dialogues, sft_on_dialogues
    from verl.single_controller.ray import RayResourcePool
    from verl.trainer.config_schema import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    started = time.monotonic()
    dialogues = scripted_dialogues(SCENARIO, SFT_DIALOGUES, QUALITY_MIX, seed=SEED, max_turns=MAX_TURNS,
                                   system_prompt=SYSTEM_PROMPT)
    warm = sft_on_dialogues(tiny_model_path, tmp_path / "warm", dialogues, steps=SFT_STEPS, lr=SFT_LR,
                            batch_size=8, seed=SEED, max_length=1024)
    sft_s = time.monotonic() - started

    config = compose_config(_overrides(warm, _prompt_data(tmp_path / "data", 64, seed=SEED), tmp_path, sim_urls),
                            config_name="sead_trainer")
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    trainer = RayPPOTrainer(config, load_tokenizer(str(warm)), {Role.ActorRollout: ActorRolloutRefWorker}, pool)
    try:
        trainer.init_workers()
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()
    total_s = time.monotonic() - started

    _check_rows_carry_their_own_dialogue(trainer.last_batch, load_tokenizer(str(warm)))
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    metrics = {m["step"]: m for m in lines}
    assert sorted(metrics) == list(range(1, GRPO_STEPS + 1))
    reward = [metrics[s]["critic/score/mean"] for s in sorted(metrics)]
    completion = [metrics[s]["dialogue/completion_rate"] for s in sorted(metrics)]
    format_errors = [metrics[s]["dialogue/format_error_rate"] for s in sorted(metrics)]
    first, last = float(np.mean(reward[:4])), float(np.mean(reward[-4:]))
    summary = {"seed": SEED, "sft_s": round(sft_s, 1), "total_s": round(total_s, 1), "first4": round(first, 3),
               "last4": round(last, 3), "reward": [round(r, 3) for r in reward], "completion_rate": completion,
               "format_error_rate": [round(f, 3) for f in format_errors]}
    print(f"learning run: {json.dumps(summary)}")
    assert last > first + MARGIN, f"mean reward did not rise by a clear margin: {summary}"
    assert np.mean(format_errors[-4:]) < np.mean(format_errors[:4]), f"format errors did not fall: {summary}"
