"""The end-to-end SEAD training tests' run: the prompt files, the trainer config and the trainer on a CPU pool."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.repo import COMPACT_SYSTEM_PROMPT, SCENARIO_PATH

STEPS, PROMPTS, GROUP = 2, 4, 4
# the policy generating through vLLM in the workers (the `vllm` tests), with the engine's log-probs
VLLM_ROLLOUT = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_num_seqs=32",
                "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
                "actor_rollout_ref.rollout.calculate_log_probs=true"]


def prompt_files(out: Path) -> tuple[Path, Path]:
    """Train (16 profiles) and test (4 profiles) parquet files under `out`, with the compact system prompt."""
    from llm_agent.scenario import load_scenario
    from utils.create_prompt_data import prompt_rows, random_profiles, write_rows

    scenario = load_scenario(SCENARIO_PATH)
    paths = []
    for split, n, seed in (("train", 16, 0), ("test", 4, 1)):
        rows = prompt_rows(scenario, random_profiles(scenario, n, seed), split)
        for row in rows:
            row["prompt"] = [{"role": "system", "content": COMPACT_SYSTEM_PROMPT}, dict(row["prompt"][1])]
        paths.append(write_rows(rows, out / f"{split}.parquet"))
    return paths[0], paths[1]


def training_config(model: str, out: Path, urls: list[str], steps: int, extra: tuple[str, ...] = ()):
    """The composed `sead_trainer` config of a small GRPO run on CPU against the simulator servers at `urls`."""
    from verl.trainer.config_schema import compose_config

    train, test = prompt_files(out / "data")
    loop = "rollout_loop.config"
    return compose_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={test}",
        "data.max_prompt_length=96", "data.max_response_length=512", f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={GROUP}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"trainer.total_training_steps={steps}", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={out / 'ckpt'}", f"trainer.log_dir={out / 'logs'}",
        "trainer.val_before_train=false", f"trainer.test_freq={STEPS}", "trainer.save_freq=1",
        f"{loop}.scenario={SCENARIO_PATH}", f"{loop}.max_turns=4", f"{loop}.max_tokens_per_turn=96",
        f"{loop}.max_user_tokens=64", f"{loop}.user_sim.urls='{','.join(urls)}'", f"{loop}.user_sim.timeout_s=10",
        f"{loop}.cache.min_bucket_size=1", f"{loop}.rollout_log_path={out / 'rollouts.jsonl'}",
        f"{loop}.val_metrics_path={out / 'val_metrics.jsonl'}", *extra,
    ], config_name="sead_trainer")


def make_trainer(config):
    """(a RayPPOTrainer with the FSDP actor-rollout worker, and the critic worker when the estimator trains one, for
    `config`, its 2-process CPU resource pool)."""
    from verl.single_controller.ray import RayResourcePool
    from verl.trainer.config_schema import CRITIC_ESTIMATORS
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    critic = config.algorithm.adv_estimator in CRITIC_ESTIMATORS
    roles = {Role.ActorRollout: ActorRolloutRefWorker, **({Role.Critic: CriticWorker} if critic else {})}
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=2 if critic else 1)
    tokenizer = load_tokenizer(config.actor_rollout_ref.model.path)
    return RayPPOTrainer(config, tokenizer, roles, pool), pool


def fit_trainer(config):
    """Train `config` to the end (make_trainer, init_workers, fit), shut it down and return its last trained batch."""
    trainer, pool = make_trainer(config)
    try:
        trainer.init_workers()
        trainer.fit()
        return trainer.last_batch
    finally:
        trainer.shutdown()
        pool.remove()
