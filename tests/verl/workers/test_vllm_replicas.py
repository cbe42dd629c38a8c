"""Rollout replicas of a real 2-rank vLLM worker group (FSDP2 on gloo; two engines of TP 1, or one of TP 2) and
the async rollout loop on them. Needs the vLLM environment (``make vllm-env``)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoTokenizer


from llm_agent.scenario import load_scenario
from verl.workers.rollout.replicas import WorkerGroupEngine

from tests.helpers.gen_loop_helpers import assert_same_dialogues, greedy_rollouts_in_both_modes
from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.ppo_batch_helpers import make_prompts
from tests.helpers.vllm_group import vllm_worker_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def group(request, tiny_model_path):
    """Two engines of TP 1 (two replicas) or one of TP 2, with room for short dialogues (3,072 tokens: the
    scenario prompt alone is ~1,500)."""
    actor = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}
    with vllm_worker_group(tiny_model_path, request.param, "vllm_replicas", actor,
                           {"max_model_len": 3072, "max_num_batched_tokens": 3072}) as workers:
        yield workers


def test_each_tp_group_is_a_replica_that_generates_a_batch_of_its_own(group, tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tp = group.rollout_replica_index()
    replicas = WorkerGroupEngine(group).replicas()
    expected = [[0], [1]] if tp == [0, 1] else [[0, 1]]
    assert [r.ranks for r in replicas] == expected, tp
    prompts = make_prompts(5, len(tok), seed=3)
    prompts.meta_info.update({"response_length": 6, "do_sample": False})
    whole = group.generate_sequences(prompts)  # the data-parallel path (rows split over the ranks)
    for replica in replicas:  # greedy: any replica answers every row as the data-parallel path does
        assert torch.equal(replica.generate_sequences(prompts).batch["responses"], whole.batch["responses"])
    prompts.meta_info.update({"do_sample": True, "temperature": 1.0})
    answers = group.execute_ranks_sync("generate_replica_sequences", replicas[0].ranks, prompts)
    for other in answers[1:]:  # TP 2: both ranks ran the same requests with the same seeds
        assert torch.equal(other.batch["responses"], answers[0].batch["responses"])


def test_async_loop_on_vllm_replicas_gives_the_sync_dialogues(group, tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    outs = greedy_rollouts_in_both_modes(tok, WorkerGroupEngine(group), load_scenario(SCENARIO_PATH),
                                         [f"v{i}" for i in range(5)],
                                         per_turn=12, budget=160, max_batch_size=2)
    assert_same_dialogues(outs)
