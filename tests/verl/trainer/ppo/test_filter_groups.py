"""Dynamic sampling (algorithm.filter_groups): group selection against hand-computed fixtures, the metric
values, the accumulation over generation batches, rollout-metric merging and the config checks."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config
from verl.trainer.ppo.filter_groups import GroupFilter, filter_metric_values, prompts_with_signal
from verl.trainer.ppo.trainer_rollout import merge_rollout_metrics


def test_prompts_with_signal_by_hand():
    """n = 3 samples per prompt. p0: rewards 1, 0, 1 -> signal. p1: 1, 1, 1 -> none. p2: 0, 0 and a row the
    rollout loop re-keyed (an error row, reward 1, its own uid) -> the 2-row group is constant and a 1-row
    group has no within-group signal -> none. p3: 'completed', 'hung_up', 'completed' -> signal."""
    prompt_ids = ["p0"] * 3 + ["p1"] * 3 + ["p2"] * 3 + ["p3"] * 3
    uids = ["p0"] * 3 + ["p1"] * 3 + ["p2", "p2/error/x", "p2"] + ["p3"] * 3
    values = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, "completed", "hung_up", "completed"]
    order, kept = prompts_with_signal(prompt_ids, uids, values)
    assert order == ["p0", "p1", "p2", "p3"]
    assert kept == {"p0", "p3"}


def test_prompts_with_signal_rejects_bad_input():
    with pytest.raises(ValueError, match="one entry per row"):
        prompts_with_signal(["a", "a"], ["a"], [1, 2])
    with pytest.raises(ValueError, match="uid 'u' spans two prompts"):
        prompts_with_signal(["a", "b"], ["u", "u"], [1, 2])


def _gen_batch(tag: str, rewards: list[list[float]]) -> tuple[DataProto, list[str]]:
    """A scored generation batch: one prompt per inner list (its samples' rewards on the last token)."""
    n, rows = len(rewards[0]), [r for group in rewards for r in group]
    prompt_ids = [f"{tag}_{p}" for p in range(len(rewards)) for _ in range(n)]
    scores = torch.zeros(len(rows), 3)
    scores[:, -1] = torch.tensor(rows)
    row_id = np.array([f"{tag}/{i}" for i in range(len(rows))], dtype=object)
    batch = DataProto.from_dict(tensors={"token_level_scores": scores},
                                non_tensors={"uid": np.array(prompt_ids, dtype=object), "row_id": row_id})
    return batch, prompt_ids


def test_group_filter_collects_groups_with_a_signal_over_generation_batches_by_hand():
    """Train batch of 3 prompts, n = 2. Batch a: only a1 differs. Batch b: b0, b2, b3 differ, b1 does not.
    Kept: a1, b0, b2 (in generation order); b3 is surplus; a0, a2, b1 are zero-signal groups."""
    groups = GroupFilter(num_prompts=3, rows_per_prompt=2, metric="seq_reward")
    batch_a, ids_a = _gen_batch("a", [[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    groups.add(batch_a, ids_a)
    assert not groups.full and groups.kept == 1
    with pytest.raises(RuntimeError, match="only 1 of 3"):
        groups.batch()
    batch_b, ids_b = _gen_batch("b", [[0.0, 2.0], [3.0, 3.0], [1.0, 0.0], [5.0, 4.0]])
    groups.add(batch_b, ids_b)
    assert groups.full
    out = groups.batch()
    assert list(out.non_tensor_batch["row_id"]) == ["a/2", "a/3", "b/0", "b/1", "b/4", "b/5"]
    assert out.batch["token_level_scores"][:, -1].tolist() == [0.0, 1.0, 0.0, 2.0, 1.0, 0.0]
    assert groups.stats.metrics(3) == {
        "filter_groups/num_gen_batches": 2.0, "filter_groups/groups_generated": 7.0,
        "filter_groups/groups_kept": 3.0, "filter_groups/groups_zero_signal": 3.0,
        "filter_groups/groups_surplus": 1.0, "filter_groups/zero_signal_frac": 3 / 7}


def test_group_filter_checks_rows_per_prompt():
    groups = GroupFilter(num_prompts=1, rows_per_prompt=3, metric="seq_reward")
    batch, ids = _gen_batch("a", [[1.0, 0.0]])
    with pytest.raises(ValueError, match="2 rows holds 1 prompts, not 3 rows each"):
        groups.add(batch, ids)


def test_filter_metric_values_from_tensors_and_columns():
    batch, _ = _gen_batch("a", [[1.0, 2.0]])
    assert filter_metric_values(batch, "seq_reward").tolist() == [1.0, 2.0]
    assert filter_metric_values(batch, "seq_final_reward").tolist() == [1.0, 2.0]  # no KL penalty applied yet
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"] - 0.25
    assert filter_metric_values(batch, "seq_final_reward").tolist() == [0.25, 1.25]
    batch.non_tensor_batch["outcome"] = np.array(["completed", "timeout"], dtype=object)
    assert list(filter_metric_values(batch, "outcome")) == ["completed", "timeout"]
    with pytest.raises(KeyError, match=r"metric='acc' is neither .* columns: \['outcome', 'row_id', 'uid'\]"):
        filter_metric_values(batch, "acc")


def test_merge_rollout_metrics_sums_durations_and_averages_the_rest():
    parts = [{"rollout/time_generate_s": 2.0, "rollout/completion_rate": 0.5},
             {"rollout/time_generate_s": 3.0, "rollout/completion_rate": 0.25, "rollout/only_here": 1.0}]
    assert merge_rollout_metrics(parts) == {"rollout/time_generate_s": 5.0, "rollout/completion_rate": 0.375,
                                            "rollout/only_here": 1.0}


@pytest.fixture()
def paths(paths: list[str]) -> list[str]:
    return [*paths, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]


def test_filter_groups_config_is_checked(paths):
    cfg = load_config(compose_config(paths))
    assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.metric,
            cfg.algorithm.filter_groups.max_num_gen_batches) == (False, "seq_reward", 0)
    on = ["algorithm.filter_groups.enable=true"]
    assert load_config(compose_config(paths + on + ["algorithm.filter_groups.metric=outcome"])).algorithm \
        .filter_groups.metric == "outcome"
    with pytest.raises(ConfigError, match=r"filter_groups\.enable keeps prompt groups whose samples differ: "
                                          r".*rollout\.n >= 2 \(got 1\)"):
        load_config(compose_config(paths + on + ["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae"]))
    with pytest.raises(ConfigError, match=r"filter_groups\.max_num_gen_batches must be >= 0"):
        load_config(compose_config(paths + ["algorithm.filter_groups.max_num_gen_batches=-1"]))
    with pytest.raises(ConfigError, match=r"metric=seq_final_reward with algorithm\.use_kl_in_reward=true"):
        load_config(compose_config(paths + on + ["algorithm.filter_groups.metric=seq_final_reward",
                                                 "algorithm.use_kl_in_reward=true"]))
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.enable must be true or false"):
        load_config(compose_config(paths + ["algorithm.filter_groups.enable=maybe"]))
