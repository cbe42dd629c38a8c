"""SEAD training end to end on the real trainer (Ray, 2 FSDP workers, two scripted simulator servers).

One run of two GRPO steps with the cache and the controller on, during which one simulator instance is
SIGKILLed mid-step; then: every step completed and no dialogue was lost or mislabelled, each row's reward belongs
to its own dialogue after balancing (the row's decoded agent tokens are checked against its record first), a cached
turn never moves a user's state more than the simulator itself does, validation wrote its metrics line, and a
trainer resumed from the checkpoint gets back the controller's weights and exactly the checkpoint's cache, even
after the live cache file gained replies.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.sead_training_run import GROUP, PROMPTS, STEPS, make_trainer, training_config
from tests.helpers.gen_loop_helpers import column

SCENARIO = SCENARIO_PATH


@pytest.fixture()
def sims(tmp_path):
    from tests.helpers.sim_servers import SimServers

    servers = SimServers(tmp_path)
    urls = [servers.start("--scenario", str(SCENARIO)) for _ in range(2)]
    try:
        servers.wait_ready(*urls)
        yield servers, urls
    finally:
        servers.stop_all()


def _largest_state_jumps(lines: list[dict]) -> tuple[int, int]:
    """(largest jump on a cached turn, largest jump on a simulator turn): max over dimensions of |state - the
    dialogue's previous state|, the previous state being the sampled profile before the first user turn."""
    jumps = {"cache": [0], "simulator": [0]}
    for line in lines:
        previous = {d: line["profile"][d] for d in ("cooperation", "emotion", "trust")}
        for turn in line["turns"]:
            state, source = turn["user_state"], turn["user_source"]
            if source in jumps and state:
                jumps[source].append(max(abs(state[d] - previous[d]) for d in previous if state.get(d) is not None))
                previous.update({d: v for d, v in state.items() if v is not None})
    return max(jumps["cache"]), max(jumps["simulator"])


def _seed_cache(path: Path) -> None:
    """Write, before training, one stored reply per (stage, state level) of the cache, each recorded in an extreme
    user state (every dimension at its minimum or at its maximum): every staged agent turn finds a bucket to hit
    whatever the warm model's share of well-formed turns, and a loop that took a cached reply's state instead of
    the dialogue's own would jump the user's state across the whole range."""
    from llm_agent.scenario import load_scenario

    scenario = load_scenario(SCENARIO)
    ranges = scenario.state_ranges
    states = [{d: r.min for d, r in ranges.items()}, {d: (r.min + r.max) // 2 for d, r in ranges.items()},
              {d: r.max for d, r in ranges.items()}]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for stage in scenario.stage_ids:
            for i, state in enumerate(states):
                f.write(json.dumps({"scenario": scenario.name, "stage": stage, "reply": f"Seeded reply {stage}.{i}.",
                                    "state": state, "status": 0, "ts": time.time()}) + "\n")


def _kill_when_busy(trainer, servers, url: str, killed: list) -> threading.Thread:
    """SIGKILL the instance at `url` once it has served simulator turns during training step 1."""
    name = url.split("//", 1)[1]

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            loop = trainer.rollout_loop
            stats = loop.client.stats() if loop is not None and loop.client is not None else {}
            if trainer.global_steps == 1 and stats.get(f"user_sim/{name}/successes", 0) >= 2:
                os.kill(servers.procs[url].pid, signal.SIGKILL)
                killed.append(time.monotonic())
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _outcome_matches_transcript(line: dict) -> bool:
    turns, outcome = line["turns"], line["outcome"]
    last_user = turns[-1]["user_status"] if turns else None
    if outcome == "completed":
        return last_user == 1
    if outcome == "hung_up":
        return last_user == -1
    if outcome == "agent_ended":  # gave up unheard, or claimed success and the user did not confirm
        gave_up = turns[-1]["agent_status"] == -1 and turns[-1]["user_source"] is None
        return gave_up or (turns[-1]["agent_status"] == 1 and last_user == 0)
    if outcome == "error":
        return turns[-1]["user_error"] is not None
    return last_user not in (1, -1)


@pytest.mark.extended  # 82 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_sead_training_survives_a_killed_simulator_and_resumes_controller_and_cache(
        warm_model_path, tmp_path, sims, ray_cluster):
    from llm_agent.reward import compute_reward

    servers, urls = sims
    config = training_config(warm_model_path, tmp_path, urls, STEPS,
                             ("rollout_loop.config.cache.stage_hit_rates={0:1.0,1:1.0,2:1.0,3:1.0}",))
    _seed_cache(Path(config.rollout_loop.config.cache.path))
    trainer, pool = make_trainer(config)
    killed: list[float] = []
    try:
        trainer.init_workers()
        watcher = _kill_when_busy(trainer, servers, urls[1], killed)
        trainer.fit()
        watcher.join(timeout=1)
        batch = trainer.last_batch
        saved_loop = trainer.rollout_loop.state_dict()
        saved_controller = saved_loop["controller"]
        cache_size = len(trainer.rollout_loop.cache)
    finally:
        trainer.shutdown()
        pool.remove()
    assert killed, "the simulator was never killed during step 1 (no simulator traffic?)"

    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [1, 2]
    killed_name = urls[1].split("//", 1)[1]
    assert metrics[1][f"user_sim/{killed_name}/failures"] + metrics[2][f"user_sim/{killed_name}/failures"] >= 1
    assert all(metrics[s]["dialogue/n_dialogues"] == PROMPTS * GROUP for s in (1, 2))

    # nothing lost or mislabelled: every dialogue of every step is logged once with an outcome its turns support
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["split"] == "train"]
    assert sorted(line["step"] for line in train) == [1] * 16 + [2] * 16
    # the workers report the policy version that sampled each agent turn: the actor's updates so far
    for step in (1, 2):
        assert {t["policy_version"] for line in train if line["step"] == step for t in line["turns"]} == {step - 1}
    assert {t["policy_version"] for line in lines if line["split"] == "val" for t in line["turns"]} == {STEPS}
    assert len({(line["step"], line["dialogue_id"]) for line in train}) == 32
    bad = [(line["dialogue_id"], line["outcome"]) for line in lines if not _outcome_matches_transcript(line)]
    assert bad == []
    cached_jump, simulator_jump = _largest_state_jumps(train)
    assert any(t["user_source"] == "cache" for line in train for t in line["turns"]), "no cached turn to check"
    assert cached_jump <= simulator_jump, (cached_jump, simulator_jump)
    errors = [line for line in train if line["outcome"] == "error"]
    assert all(line["reward"] == 0.0 for line in errors)
    assert sum(t["user_source"] in ("simulator", "cache") for line in train for t in line["turns"]) > 0

    # rewards sit on each row's own last agent token, computed from that row's own dialogue, after balancing: the
    # record is first shown to be the row's own by decoding the row's loss-carrying tokens (tensors vs records)
    from tests.helpers.row_alignment import misaligned_rows

    assert misaligned_rows(batch, trainer.tokenizer) == []
    scores = batch.batch["token_level_scores"]
    reward_kwargs = OmegaConf.to_container(config.reward.kwargs, resolve=True)
    for row in range(len(batch)):
        alone = batch.select_idxs([row])
        expected, _ = compute_reward(alone, None, **reward_kwargs)
        assert torch.equal(expected[0], scores[row]), f"row {row}"
        mask = batch.batch["response_mask"][row]
        if column(batch, "outcome")[row] == "error":
            assert mask.sum() == 0 and "/error/" in batch.non_tensor_batch["uid"][row]
        else:
            last = int(mask.nonzero().max())
            assert scores[row].nonzero().flatten().tolist() in ([], [last])

    # validation wrote one line for the last step
    val = [json.loads(line) for line in (tmp_path / "val_metrics.jsonl").read_text().splitlines()]
    assert [v["step"] for v in val] == [STEPS] and val[0]["n_dialogues"] == 4
    assert val[0]["metrics"]["completion_rate"] == metrics[STEPS]["val/dialogue/completion_rate"]

    # a resumed trainer gets the controller's weights and the cache's RNG back, and exactly the checkpoint's cache
    # replies, although the live cache file gained replies after the checkpoint (a crash before the next one)
    live = Path(config.rollout_loop.config.cache.path)
    late = {"scenario": "outbound_ad_trial", "stage": 0, "reply": "A reply added after the checkpoint.",
            "state": {"cooperation": 2, "emotion": 2, "trust": 2}, "status": 0, "ts": time.time()}
    with open(live, "a", encoding="utf-8") as f:
        f.write(json.dumps(late) + "\n")
    state = json.loads((tmp_path / "ckpt" / f"global_step_{STEPS}" / "trainer_state.json").read_text())
    assert state["rollout_loop"]["controller"] == saved_controller
    assert saved_controller["updates"] == STEPS
    resumed, pool = make_trainer(training_config(warm_model_path, tmp_path, [urls[0]], STEPS + 1))
    try:
        resumed.init_workers()
        resumed.load_checkpoint()
        assert resumed.global_steps == STEPS
        assert resumed.rollout_loop.state_dict() == json.loads(json.dumps(saved_loop))  # controller, cache RNG
        assert len(resumed.rollout_loop.cache) == cache_size > 0
        assert "A reply added after the checkpoint." not in live.read_text()
    finally:
        resumed.shutdown()
        pool.remove()


CORRECTION = ("actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=turn",
              "algorithm.rollout_correction.rollout_rs=turn_mean_k3",
              "algorithm.rollout_correction.rollout_rs_threshold=0.01")


@pytest.mark.slow
def test_sead_training_step_in_async_mode(warm_model_path, tmp_path, sims, ray_cluster):
    """One GRPO step with rollout_loop.config.mode=async (cache and controller on) and turn-level rollout
    correction on the real trainer: every dialogue is logged with an outcome its turns support, each row's reward
    is its own, the controller learnt from the step, the pacing metrics reach the step's metrics, and so do the
    rollout/training mismatch metrics of the dialogues (overall and per agent turn) and the correction's: the HF
    rollout and the actor hold the same fp32 weights, so the mismatch is float noise and nothing is rejected (a
    log-prob put under the wrong token would be off by nats)."""
    _, urls = sims
    config = training_config(warm_model_path, tmp_path, urls, 1, ("rollout_loop.config.mode=async",
                                                                  "trainer.save_freq=-1", "trainer.test_freq=-1",
                                                                  *CORRECTION))
    trainer, pool = make_trainer(config)
    try:
        trainer.init_workers()
        trainer.fit()
        batch = trainer.last_batch
        controller = trainer.rollout_loop.state_dict()["controller"]
    finally:
        trainer.shutdown()
        pool.remove()
    metrics = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["step"] == 1 and metrics["dialogue/n_dialogues"] == PROMPTS * GROUP
    assert 0 < metrics["rollout/generate_busy_fraction"] <= 1 and metrics["rollout/generate_batches"] >= 1
    assert metrics["rollout/dialogue_time_p95_s"] <= metrics["rollout/time_to_last_dialogue_s"] + 1e-6
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len({line["dialogue_id"] for line in lines}) == PROMPTS * GROUP
    assert [line for line in lines if not _outcome_matches_transcript(line)] == []
    from tests.helpers.row_alignment import misaligned_rows

    assert misaligned_rows(batch, trainer.tokenizer) == []
    assert controller["updates"] == 1
    assert "rollout_log_probs" in batch.batch.keys() and "agent_turn_ids" in batch.batch.keys()
    # k3 >= 0 in exact arithmetic; another CPU's kernels leave float noise on either side of 0 (-7.4e-10 seen)
    assert -1e-6 < metrics["rollout/kl_k3"] < 1e-6 and 0 <= metrics["rollout/logprob_abs_diff_max"] < 1e-3
    most_turns = max(line["num_turns"] for line in lines)
    assert most_turns >= 2, "no dialogue with a second agent turn to break the mismatch down by"
    for k in range(min(most_turns, 8)):
        assert -1e-6 < metrics[f"rollout/kl_k3_turn_{k}"] < 1e-6
        assert 0 <= metrics[f"rollout/logprob_abs_diff_mean_turn_{k}"] < 1e-4
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
