"""One-step-off training end to end (Ray, 2 FSDP workers, the multi-turn loop against scripted simulators with
heavy-tailed injected latency): every trained token's recorded policy version and behaviour log-prob are those of
the weights that sampled it, recomputed here with a plain HF model loaded from a copy of each version's weights, and
the importance weights of the decoupled-PPO correction equal a float64 recomputation. With staleness 2 the rollouts
queue ahead and every trained token stays within the bound, also with two of them in flight at once. And with nothing
to overlap (a checkpoint every step) the one-step-off and staleness-2 paths (one rollout at a time or two) train
exactly the synchronous trainer's batches, also with the rollout on processes of its own (split placement), where
one-step-off records the versions and behaviour log-probs of the weights each sync installed (HF or vLLM).
Rollouts keep going across a validation, which sees the dialogues a quiet engine gives."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.sead_training_run import VLLM_ROLLOUT, fit_trainer, make_trainer, training_config
from verl.utils.agent_turns import AGENT_TURN_IDS
from verl.workers.rollout.engine import ROLLOUT_POLICY_VERSIONS

ONE_STEP_OFF = ("async_training.staleness_threshold=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
                "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
                "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.resume_mode=disable",
                "rollout_loop.config.max_turns=3", "rollout_loop.config.max_tokens_per_turn=24",
                # the tiny model's dialogues all get one reward (no advantage): the entropy term moves the weights
                "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.optim.lr=1e-2")
STALENESS_2 = tuple(o.replace("staleness_threshold=1", "staleness_threshold=2") for o in ONE_STEP_OFF) + (
    "async_training.partial_rollout=true",)
IN_FLIGHT_2 = STALENESS_2 + ("async_training.rollouts_in_flight=2",)
SPLIT = ("actor_rollout_ref.rollout.n_gpus_per_node=2",)  # the rollout on 2 CPU processes of its own
LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16")
SYNCHRONOUS = tuple(o.replace("staleness_threshold=1", "staleness_threshold=0") for o in ONE_STEP_OFF)
THRESHOLD = 2.0


class SavingEachVersion:
    """The actor worker group, saving the weights (HF export) after each update as `<out>/v<version>`."""

    def __init__(self, worker_group, out: Path) -> None:
        self.worker_group, self.out, self.version = worker_group, out, 0

    def __getattr__(self, name):
        return getattr(self.worker_group, name)

    def update_actor(self, batch):
        result = self.worker_group.update_actor(batch)
        self.version += 1
        self.worker_group.save_checkpoint(str(self.out / f"v{self.version}"), save_hf_model=True)
        return result


def _sims(log_dir: Path, *flags: str):
    from tests.helpers.repo import SCENARIO_PATH
    from tests.helpers.sim_servers import SimServers

    servers = SimServers(log_dir)
    urls = [servers.start("--scenario", str(SCENARIO_PATH), *flags) for _ in range(2)]
    try:
        servers.wait_ready(*urls)
        yield urls
    finally:
        servers.stop_all()


@pytest.fixture()
def slow_sims(tmp_path):
    """Two scripted simulators answering after a lognormal latency (median 30 ms, sigma 1.5: heavy-tailed)."""
    yield from _sims(tmp_path / "sims", "--inject-latency-ms", "30", "--inject-latency-sigma", "1.5")


def _log_probs(path: str, batch, dtype: torch.dtype) -> torch.Tensor:
    """log softmax(logits) of every response token of `batch` under the HF model at `path` (float `dtype`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    b = batch.batch
    width = b["responses"].size(1)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits.to(dtype)
    logits = logits[:, -width - 1:-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.slow  # 16-27 s measured (a shared 2-core box)
@pytest.mark.processes
@pytest.mark.parametrize("placement", [(), pytest.param(SPLIT, marks=pytest.mark.extended),
                                       pytest.param(SPLIT + tuple(VLLM_ROLLOUT),
                                                    marks=[pytest.mark.extended, pytest.mark.vllm])],
                         ids=["colocated", "split", "split-vllm"])
def test_one_step_off_records_each_tokens_version_and_behaviour_log_prob(tiny_model_path, tmp_path, slow_sims,
                                                                         ray_cluster, placement):
    config = training_config(tiny_model_path, tmp_path, slow_sims, 2, ONE_STEP_OFF + placement)
    trainer, pool = make_trainer(config)
    try:
        trainer.init_workers()
        saving = SavingEachVersion(trainer.actor_rollout_wg, tmp_path / "versions")
        trainer.actor_rollout_wg = saving
        trainer.fit()
        batch = trainer.last_batch
    finally:
        trainer.shutdown()
        pool.remove()
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines())}
    assert metrics[1]["async/staleness_max"] == 0  # step 1's rollout ran before any update
    assert metrics[2]["async/policy_version"] == 1 and metrics[2]["async/staleness_max"] <= 1

    # step 2 trained step 2's rollout, sampled by version 0 (the model) and/or 1 (after step 1's update)
    mask = batch.batch["response_mask"].bool()
    versions = batch.batch[ROLLOUT_POLICY_VERSIONS]
    assert set(versions[mask].tolist()) <= {0, 1} and bool((versions[~mask] == -1).all())
    paths = {0: tiny_model_path, 1: str(tmp_path / "versions" / "v1")}
    stale = (versions == 0) & mask
    # rollout 2 starts before step 1 trains, so its first turns are sampled by version 0 before the update
    assert bool(stale.any())
    assert metrics[2]["async/tokens_stale_frac"] == pytest.approx(float(stale.sum() / mask.sum()))

    # one version per agent turn, the one the dialogue record got from the engine
    turns = batch.batch[AGENT_TURN_IDS]
    for row, record in enumerate(batch.non_tensor_batch["dialogue"]):
        agent_versions = [t.policy_version for t in record.turns if t.policy_version is not None]
        for k in range(int(turns[row].max()) + 1):
            in_turn = versions[row][turns[row] == k]
            assert in_turn.numel() == 0 or set(in_turn.tolist()) == {agent_versions[k]}, (row, k)

    # each token's behaviour log-prob is its sampling version's log-prob, recomputed from that version's weights
    rollout = batch.batch["rollout_log_probs"]
    recomputed = {v: _log_probs(p, batch, torch.float32) for v, p in paths.items()}
    for v, lp in recomputed.items():
        sampled_by_v = (versions == v) & mask
        if sampled_by_v.any():
            assert torch.allclose(lp[sampled_by_v], rollout[sampled_by_v], atol=2e-4), v
    assert not torch.allclose(recomputed[0][mask], recomputed[1][mask], atol=1e-2), "the update changed nothing"

    # decoupled PPO: weight = min(exp(proximal - behaviour), threshold), proximal = version 1 (the trainer's)
    exact = {v: _log_probs(p, batch, torch.float64) for v, p in paths.items()}
    behaviour = torch.where(versions == 0, exact[0], exact[1])
    expected = torch.exp(exact[1] - behaviour).clamp(max=THRESHOLD)
    weights = batch.batch["rollout_is_weights"].to(torch.float64)
    assert torch.allclose(weights[mask], expected[mask], rtol=1e-3, atol=1e-4)
    assert torch.allclose(weights[mask & ~stale], torch.ones_like(weights[mask & ~stale]), atol=1e-3)


def _trained_batch(model: str, out: Path, extra: tuple[str, ...]):
    """The last batch of a 2-step run with a checkpoint every step, against fresh instant simulators."""
    sims = _sims(out / "sims")
    urls = next(sims)
    try:
        return fit_trainer(training_config(model, out, urls, 2, (*extra, "trainer.save_freq=1")))
    finally:
        sims.close()


@pytest.mark.extended  # 31-35 s each measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow  # 17 s measured (4 steps, 2 rollouts queued ahead; a shared 2-core box)
@pytest.mark.processes
@pytest.mark.parametrize("mode", [STALENESS_2, IN_FLIGHT_2], ids=["one-after-another", "two-in-flight"])
def test_staleness_two_trains_within_the_bound_with_rollouts_queued_ahead(tiny_model_path, tmp_path, slow_sims,
                                                                         ray_cluster, mode):
    batch = fit_trainer(training_config(tiny_model_path, tmp_path, slow_sims, 4, mode))
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines())}
    assert [metrics[s]["async/policy_version"] for s in (1, 2, 3, 4)] == [0, 1, 2, 3]
    # after step s is taken, steps up to min(s + 2, 4) are queued: 2, 2, 1, 0 (nothing in flight past the last)
    assert [metrics[s]["async/rollouts_queued"] for s in (1, 2, 3, 4)] == [2, 2, 1, 0]
    assert all(metrics[s]["async/staleness_max"] <= 2 for s in (1, 2, 3, 4))
    assert all(metrics[s]["async/dropped_stale_dialogues"] == 0 for s in (1, 2, 3, 4))
    mask = batch.batch["response_mask"].bool()
    versions = batch.batch[ROLLOUT_POLICY_VERSIONS][mask]  # step 4 trains from version 3: tokens of 1, 2 or 3
    assert set(versions.tolist()) <= {1, 2, 3}
    assert metrics[4]["async/staleness_max"] == 3 - int(versions.min())


@pytest.fixture(scope="module")
def synchronous_batch(tiny_model_path, tmp_path_factory):
    """The synchronous trainer's last batch of `_trained_batch` (one run shared by the module's modes)."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        return _trained_batch(tiny_model_path, tmp_path_factory.mktemp("sync"), SYNCHRONOUS)
    finally:
        ray.shutdown()


@pytest.mark.extended  # 29-32 s each, and 60 s for the synchronous reference: make test-extended (CI)
@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("mode", [ONE_STEP_OFF, STALENESS_2, IN_FLIGHT_2, SYNCHRONOUS + SPLIT, ONE_STEP_OFF + SPLIT],
                         ids=["one-step-off", "staleness-2", "two-in-flight", "split-sync", "split-one-step-off"])
def test_with_nothing_to_overlap_off_policy_trains_the_synchronous_batches(tiny_model_path, tmp_path,
                                                                            synchronous_batch, ray_cluster, mode):
    off, sync = _trained_batch(tiny_model_path, tmp_path / "off", mode), synchronous_batch
    assert set(off.batch.keys()) == set(sync.batch.keys())
    for key in sorted(off.batch.keys()):
        assert torch.equal(off.batch[key], sync.batch[key]), key
    assert list(off.non_tensor_batch["uid"]) == list(sync.non_tensor_batch["uid"])


@pytest.mark.extended  # 56 s measured: two trainer runs (make test-extended, CI)
@pytest.mark.slow
@pytest.mark.processes
def test_a_lora_actor_with_a_rollout_of_its_own_trains_the_colocated_batches(tiny_model_path, tmp_path, ray_cluster):
    """Split placement syncs the adapter alone after each update; with nothing to overlap, one-step-off on a
    rollout of its own trains exactly the colocated synchronous LoRA batches (the behaviour log-probs included)."""
    colocated = _trained_batch(tiny_model_path, tmp_path / "colocated", SYNCHRONOUS + LORA)
    split = _trained_batch(tiny_model_path, tmp_path / "split", ONE_STEP_OFF + SPLIT + LORA)
    assert set(split.batch.keys()) == set(colocated.batch.keys())
    for key in sorted(split.batch.keys()):
        assert torch.equal(split.batch[key], colocated.batch[key]), key
    metrics = [json.loads(line) for line in (tmp_path / "split" / "logs" / "metrics.jsonl").read_text().splitlines()]
    layers = json.loads((Path(tiny_model_path) / "config.json").read_text())["num_hidden_layers"]
    adapter_tensors = 2 * 7 * layers  # A and B of the 7 linear layers of each decoder layer
    assert [m["rollout/weight_sync_tensors"] for m in metrics] == [adapter_tensors] * len(metrics)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.extended  # 48-69 s each measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.parametrize("mode", [ONE_STEP_OFF, STALENESS_2, IN_FLIGHT_2, ONE_STEP_OFF + SPLIT],
                         ids=["one-step-off", "staleness-2", "two-in-flight", "split-one-step-off"])
def test_a_resume_at_a_checkpoint_trains_the_uninterrupted_runs_next_batch(tiny_model_path, tmp_path, ray_cluster,
                                                                           mode):
    # steps 1 -> 2 overlap; step 2 ends with a checkpoint, so step 3's rollout starts after it in both runs, from
    # the checkpoint's loader position, weights and rollout-loop state (with staleness 2 nothing is queued past 2)
    resumable = tuple(o for o in mode if "save_freq" not in o and "resume_mode" not in o)
    sims = _sims(tmp_path / "sims")
    urls = next(sims)
    try:
        batches = {}
        for name, steps in (("uninterrupted", 3), ("resumed", 3)):
            out = tmp_path / name
            extra = (*resumable, "trainer.save_freq=2", "trainer.resume_mode=auto")
            if name == "resumed":  # a copy of the uninterrupted run's step-2 checkpoint only
                import shutil

                shutil.copytree(tmp_path / "uninterrupted" / "ckpt", out / "ckpt",
                                ignore=shutil.ignore_patterns("global_step_3*"))
                (out / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
            trainer, pool = make_trainer(training_config(tiny_model_path, out, urls, steps, extra))
            try:
                trainer.init_workers()
                trainer.fit()
                batches[name] = trainer.last_batch
            finally:
                trainer.shutdown()
                pool.remove()
    finally:
        sims.close()
    a, b = batches["uninterrupted"], batches["resumed"]
    assert list(a.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])
    for key in ("input_ids", "responses", "response_mask", ROLLOUT_POLICY_VERSIONS, "rollout_log_probs",
                "old_log_probs", "advantages"):
        assert torch.equal(a.batch[key], b.batch[key]), key


def _val_dialogues(rollout_log: Path, step: int) -> dict[str, tuple]:
    """The validation dialogues of `step` in a run's rollout log: id -> (outcome, agent and user texts per turn)."""
    lines = [json.loads(line) for line in rollout_log.read_text().splitlines()]
    return {d["dialogue_id"]: (d["outcome"], [(t["agent_text"], t["user_reply"]) for t in d["turns"]])
            for d in lines if d["split"] == "val" and d["step"] == step}


@pytest.mark.extended  # two trainer runs: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("mode", [ONE_STEP_OFF, IN_FLIGHT_2], ids=["one-step-off", "two-in-flight"])
def test_rollouts_keep_going_across_validations_which_see_the_dialogues_of_a_quiet_engine(
        tiny_model_path, tmp_path, slow_sims, ray_cluster, mode):
    validating = ("trainer.val_before_train=true", "trainer.test_freq=2")
    fit_trainer(training_config(tiny_model_path, tmp_path / "off", slow_sims, 4, (*mode, *validating)))
    fit_trainer(training_config(tiny_model_path, tmp_path / "quiet", slow_sims, 4, (*SYNCHRONOUS, *validating,
                                                                           "trainer.val_only=true")))
    log = tmp_path / "off" / "logs" / "metrics.jsonl"
    metrics = {m["step"]: m for m in map(json.loads, log.read_text().splitlines())}
    if "rollouts_in_flight=2" in " ".join(mode):
        # step 2 ends with a validation: after taking it, the trainer still queues steps 3 and 4
        assert [metrics[s]["async/rollouts_queued"] for s in (1, 2, 3, 4)] == [2, 2, 1, 0]
    else:
        # step 3's rollout started during step 2 (its first turns sampled by version 1) and ran across the validation
        assert metrics[3]["async/policy_version"] == 2 and metrics[3]["async/staleness_max"] == 1
    # the validation before training ran beside step 1's rollouts, on the same weights as the quiet run's
    ran_beside = _val_dialogues(tmp_path / "off" / "rollouts.jsonl", 0)
    assert len(ran_beside) == 4 and ran_beside == _val_dialogues(tmp_path / "quiet" / "rollouts.jsonl", 0)
