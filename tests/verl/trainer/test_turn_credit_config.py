"""The turn-level credit keys (algorithm.turn_mixed, algorithm.diagnosis_reweight, adv_estimator=turn_*):
defaults leave today's runs unchanged, bad values are refused naming the key, turn_gae trains a critic, and the
trainer's advantage call hands each estimator the inputs it names."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from verl.errors import ContractError
from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError, DiagnosisReweightConfig, compose_config
from verl.trainer.config_validation import load_config
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage

D = "algorithm.diagnosis_reweight"
# a reward plug-in that writes what the turn-level options read (per-turn rewards, failure labels)
TURN_REWARD = ["reward.path=llm_agent.reward.compute_reward", "+reward.kwargs.turn_weights={state_change:1.0}"]


def test_defaults_leave_todays_runs_unchanged(paths):
    for config_name in ("ppo_trainer", "sead_trainer"):
        cfg = load_config(compose_config(paths, config_name=config_name), check_paths=False)
        assert cfg.algorithm.diagnosis_reweight.enable is False and cfg.algorithm.diagnosis_reweight.weights == {}
        assert cfg.algorithm.adv_estimator in ("gae", "grpo")
    assert load_config(compose_config(paths)).algorithm.turn_mixed.turn_weight == 1.0


def test_turn_estimators_are_registered_and_turn_gae_trains_a_critic(paths):
    assert {"turn_mixed", "turn_gae"} <= set(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert load_config(compose_config(paths + ["algorithm.adv_estimator=turn_gae"])).need_critic is True
    mixed = load_config(compose_config(paths + TURN_REWARD + ["algorithm.adv_estimator=turn_mixed",
                                                              "actor_rollout_ref.rollout.n=4"]))
    assert mixed.need_critic is False
    with pytest.raises(ConfigError, match="set actor_rollout_ref.rollout.n >= 2"):
        load_config(compose_config(paths + TURN_REWARD + ["algorithm.adv_estimator=turn_mixed"]))
    with pytest.raises(ConfigError, match="critic.model.path=None must be a local model directory "
                                          r"\(algorithm.adv_estimator=turn_gae trains a critic\)"):
        load_config(compose_config(paths + ["algorithm.adv_estimator=turn_gae", "critic.model.path=null"]))


@pytest.mark.parametrize("override, message", [
    ("algorithm.turn_mixed.turn_weight=nan", r"algorithm\.turn_mixed\.turn_weight must be a finite number"),
    ("algorithm.turn_mixed.turn_weight=inf", r"algorithm\.turn_mixed\.turn_weight must be a finite number"),
    ("algorithm.turn_mixed.turn_weight=-1", r"algorithm\.turn_mixed\.turn_weight=-1\.0 is outside \[0, inf\)"),
    (f"+{D}.weights={{false_claim:2.5}}", rf"{D}\.weights\.false_claim=2\.5 is outside \[0, 2\]"),
    (f"+{D}.weights={{false_claim:-0.5}}", rf"{D}\.weights\.false_claim=-0\.5 is outside \[0, 2\]"),
    (f"+{D}.weights={{false_claim:nan}}", rf"{D}\.weights\.false_claim must be a finite number, got nan"),
    (f"+{D}.weights={{false_claim:inf}}", rf"{D}\.weights\.false_claim must be a finite number, got inf"),
    (f"+{D}.weights={{false_claim:true}}", rf"{D}\.weights\.false_claim must be a finite number, got True"),
    (f"+{D}.weights={{false_claim:high}}", rf"{D}\.weights\.false_claim must be a finite number, got 'high'"),
    (f"+{D}.weights={{1:1.5}}", rf"{D}\.weights: labels must be non-empty strings, got 1"),
    (f"{D}.enable=true", rf"{D}\.enable=true needs at least one label weight"),
    (f"{D}.apply_to=sometimes", rf"{D}\.apply_to must be one of \['all', 'negative', 'positive'\]"),
    (f"+{D}.enabled=true", rf"{D}\.enabled is not a config key \(did you mean {D}\.enable\?\)"),
])
def test_bad_turn_credit_values_name_the_key(paths, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(compose_config(paths + [override]))


def test_diagnosis_reweighting_scales_only_negative_advantages_by_default(paths):
    """The default (issue 35, BENCHMARKS.md "Diagnosis reweighting's apply_to"): a failure label never amplifies
    positive credit; the YAML and the schema agree."""
    cfg = load_config(compose_config(paths + TURN_REWARD + [f"{D}.enable=true", f"+{D}.weights={{false_claim:1.5}}"]))
    assert cfg.algorithm.diagnosis_reweight.apply_to == "negative"
    assert DiagnosisReweightConfig().apply_to == "negative"


def test_valid_diagnosis_config_loads(paths):
    cfg = load_config(compose_config(paths + TURN_REWARD + [f"{D}.enable=true",
                                                            f"+{D}.weights={{false_claim:1.5,truncated:0}}",
                                                            f"+{D}.weights.premature_push=2", f"{D}.apply_to=negative"]))
    assert cfg.algorithm.diagnosis_reweight.weights == {"false_claim": 1.5, "truncated": 0, "premature_push": 2}
    assert cfg.algorithm.diagnosis_reweight.apply_to == "negative"


# ----------------------------------------------------------------------------------- the trainer's advantage call
def _dialogue_batch() -> DataProto:
    """Two groups of two rows; agent turns broken by user tokens; outcome rewards, turn scores and values."""
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 1, 0], [1, 0, 1, 0, 1, 1]])
    rewards = torch.zeros(4, 6)
    rewards[[0, 1, 2, 3], [3, 4, 4, 5]] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    turn_scores = torch.zeros(4, 6)
    turn_scores[[0, 0, 1, 2, 3, 3], [1, 3, 4, 2, 0, 5]] = torch.tensor([0.5, -0.2, 0.3, 0.1, -0.4, 0.6])
    values = torch.linspace(-1, 1, 24).reshape(4, 6)
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask, "turn_scores": turn_scores,
                 "values": values},
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})


def test_compute_advantage_hands_turn_estimators_their_inputs():
    data = _dialogue_batch()
    b = data.batch
    compute_advantage(data, "turn_gae", gamma=0.9, lam=0.8)
    expected = core_algos.compute_turn_gae_advantage_return(b["token_level_rewards"], b["values"],
                                                            b["response_mask"], 0.9, 0.8, turn_scores=b["turn_scores"])
    assert torch.equal(b["advantages"], expected[0]) and torch.equal(b["returns"], expected[1])
    compute_advantage(data, "turn_mixed", norm_adv_by_std_in_grpo=False, config={"turn_mixed": {"turn_weight": 0.5}})
    expected = core_algos.compute_turn_mixed_advantage(b["token_level_rewards"], b["response_mask"],
                                                       data.non_tensor_batch["uid"], turn_scores=b["turn_scores"],
                                                       norm_adv_by_std_in_grpo=False, turn_weight=0.5)
    assert torch.equal(b["advantages"], expected[0])


def test_compute_advantage_reads_the_loops_turn_ids():
    data = _dialogue_batch()
    ids = torch.where(data.batch["response_mask"] != 0, 0, -1)  # the loop says: one agent turn per row
    data.batch["agent_turn_ids"] = ids
    compute_advantage(data, "turn_gae", gamma=0.9, lam=0.8)
    b = data.batch
    one_turn = core_algos.compute_turn_gae_advantage_return(b["token_level_rewards"], b["values"], b["response_mask"],
                                                            0.9, 0.8, agent_turn_ids=ids, turn_scores=b["turn_scores"])
    from_mask = core_algos.compute_turn_gae_advantage_return(b["token_level_rewards"], b["values"],
                                                             b["response_mask"], 0.9, 0.8, turn_scores=b["turn_scores"])
    assert torch.equal(b["advantages"], one_turn[0]) and not torch.equal(b["advantages"], from_mask[0])


def test_compute_advantage_names_a_missing_input():
    data = _dialogue_batch()
    data.batch.pop("values")
    with pytest.raises(ContractError, match=r"needs batch\['values'\] \(the critic's values"):
        compute_advantage(data, "turn_gae")
    data = _dialogue_batch()
    data.batch.pop("turn_scores")
    with pytest.raises(ContractError, match=r"needs batch\['turn_scores'\] \(the per-turn rewards, written by the "
                                            "reward or rollout-loop plug-in"):
        compute_advantage(data, "turn_mixed", config={"turn_mixed": {"turn_weight": 1.0}})


def test_compute_advantage_passes_norm_adv_by_std_to_grpo_vectorized():
    # before the estimator inputs were handed by name, grpo_vectorized always divided by the std
    data = _dialogue_batch()
    compute_advantage(data, "grpo_vectorized", norm_adv_by_std_in_grpo=False)
    b = data.batch
    expected, _ = core_algos.compute_grpo_outcome_advantage(b["token_level_rewards"], b["response_mask"],
                                                            data.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(b["advantages"], expected)


def test_compute_advantage_reads_the_turn_weight_from_the_trainers_config_object(paths):
    cfg = load_config(compose_config(paths + TURN_REWARD + ["algorithm.adv_estimator=turn_mixed",
                                                            "actor_rollout_ref.rollout.n=2",
                                                            "algorithm.turn_mixed.turn_weight=0.25"]))
    data = _dialogue_batch()
    compute_advantage(data, "turn_mixed", config=cfg.algorithm)  # the typed AlgorithmConfig, as train_step passes
    b = data.batch
    expected, _ = core_algos.compute_turn_mixed_advantage(b["token_level_rewards"], b["response_mask"],
                                                          data.non_tensor_batch["uid"], turn_scores=b["turn_scores"],
                                                          turn_weight=0.25)
    assert torch.equal(b["advantages"], expected)
