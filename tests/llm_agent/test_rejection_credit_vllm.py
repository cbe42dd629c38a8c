"""Turn-level rejection with turn-level credit, end to end: one SEAD training step on the real trainer (Ray, 2 FSDP
workers, the policy generating through vLLM in bf16 against the fp32 actor, two scripted simulator servers) with
the GPU preset's rollout correction (token-level TIS, ``turn_mean_k3`` rejection) at a threshold low enough that
the bf16 engine's mismatch rejects turns, and each turn-level option: ``turn_mixed`` and ``turn_gae``, both with
the per-turn ``state_change`` reward and the diagnosis reweighting of every label of the scenario. Measured (warm
tiny model, bf16 engine, fp32 actor): per-turn mean k3 1.5e-6 .. 6.8e-4, mean 1.3e-4, so the threshold 1e-4
rejected 41% of the turns (the preset's 0.01 would reject none); an fp32 engine's k3 is rounding (|k3| < 1e-8).

The driver's advantage step is observed (its batch copied before, and kept after): the advantages, the returns of
the kept tokens and the mask must follow the rule (credit on the dialogue as sampled, then the rejected tokens leave
the loss), checked against the float64 loops of tests/helpers/credit_reference.py. Needs the vLLM environment
(``make vllm-env``).
"""
from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from tests.helpers import credit_reference as ref
from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.sead_training_run import GROUP, PROMPTS, VLLM_ROLLOUT, make_trainer, training_config

pytestmark = [pytest.mark.vllm, pytest.mark.extended,  # ~4 min: make test-extended (CI), not make test's 20
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

LABELS = ("doubt_unanswered", "false_claim", "premature_push", "hang_up_after_drop", "format_error", "timeout_loop",
          "truncated")
WEIGHTS = {label: 1.5 for label in LABELS}
CORRECTION = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=turn_mean_k3",
              "algorithm.rollout_correction.rollout_rs_threshold=1e-4", "actor_rollout_ref.rollout.dtype=bfloat16"]
CREDIT = ["reward.kwargs.turn_weights.state_change=1.0", "algorithm.diagnosis_reweight.enable=true",
          "algorithm.diagnosis_reweight.apply_to=all",
          "+algorithm.diagnosis_reweight.weights={" + ",".join(f"{k}:{v}" for k, v in WEIGHTS.items()) + "}"]
OPTIONS = {
    "turn_mixed": ["algorithm.adv_estimator=turn_mixed", "algorithm.turn_mixed.turn_weight=0.5"],
    "turn_gae": ["algorithm.adv_estimator=turn_gae", "algorithm.gamma=0.95", "algorithm.lam=0.9",
                 "critic.ppo_micro_batch_size_per_gpu=8", "critic.forward_micro_batch_size_per_gpu=8"],
}


@pytest.fixture()
def sims(tmp_path):
    from tests.helpers.sim_servers import SimServers

    servers = SimServers(tmp_path)
    urls = [servers.start("--scenario", str(SCENARIO_PATH)) for _ in range(2)]
    try:
        servers.wait_ready(*urls)
        yield urls
    finally:
        servers.stop_all()


def _expected(sampled, option: str) -> tuple[list[list[float]], list[list[float]]]:
    """(advantages, returns) of the step by the float64 reference, from the batch the advantage step was given."""
    b = sampled.batch
    mask, ids, uid = b["response_mask"], b["agent_turn_ids"], list(sampled.non_tensor_batch["uid"])
    if option == "turn_mixed":
        advantages, returns = ref.turn_mixed(b["token_level_rewards"], mask, ids, b["turn_scores"], uid, 0.5)
    else:
        advantages, returns = ref.turn_gae(b["token_level_rewards"], b["values"], mask, ids, b["turn_scores"], 0.95,
                                           0.9)
    labels = list(sampled.non_tensor_batch["turn_labels"])
    return ref.diagnosis(advantages, ids, labels, WEIGHTS, "all"), returns


@pytest.mark.parametrize("option", list(OPTIONS))
def test_turn_rejection_with_turn_credit_trains_a_vllm_dialogue_step(option, warm_model_path, tmp_path, sims,
                                                                     ray_cluster, monkeypatch):
    from omegaconf import OmegaConf

    import verl.trainer.ppo.ray_trainer as ray_trainer

    seen = []

    def observed_step(batch, algorithm, num_repeat=1):
        before = copy.deepcopy(batch)
        metrics = real_step(batch, algorithm, num_repeat)
        seen.append((before, batch))
        return metrics

    real_step = ray_trainer.advantage_step
    monkeypatch.setattr(ray_trainer, "advantage_step", observed_step)
    config = training_config(warm_model_path, tmp_path, sims, 1, extra=(*CORRECTION, *CREDIT, *OPTIONS[option]))
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(
        VLLM_ROLLOUT + ["trainer.test_freq=-1", "trainer.save_freq=-1"]))
    trainer, pool = make_trainer(config)
    try:
        trainer.init_workers()
        trainer.fit()
    finally:
        trainer.shutdown()
        pool.remove()

    metrics = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["dialogue/n_dialogues"] == PROMPTS * GROUP
    print({k: v for k, v in metrics.items() if k.startswith(("rollout_corr/rollout_rs", "diagnosis/", "reward/turn"))})
    assert metrics["rollout_corr/rollout_rs_turn_mean_k3_turn_masked_fraction"] > 0, "no turn was rejected"
    assert "actor/pg_loss" in metrics and "diagnosis/reweighted_turns" in metrics
    assert option != "turn_gae" or "critic/vf_loss" in metrics
    [(sampled, after)] = seen
    mask = sampled.batch["response_mask"].bool()
    kept = after.batch["response_mask"].bool()
    assert bool((kept <= mask).all()) and 0 < int(kept.sum()) < int(mask.sum()), "some turns kept, some rejected"
    rejected_scores = sampled.batch["turn_scores"][mask & ~kept]
    print(f"{int((mask & ~kept).sum())} of {int(mask.sum())} agent tokens rejected; "
          f"{int((rejected_scores != 0).sum())} rejected tokens carry a turn score")
    advantages, returns = _expected(sampled, option)
    want = torch.tensor(advantages, dtype=torch.float64) * kept
    torch.testing.assert_close(after.batch["advantages"].double()[mask], want[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.batch["returns"].double()[kept], torch.tensor(returns, dtype=torch.float64)[kept],
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(after.batch["agent_turn_ids"], torch.where(kept, sampled.batch["agent_turn_ids"], -1))
    assert torch.equal(after.batch["turn_scores"], sampled.batch["turn_scores"])
