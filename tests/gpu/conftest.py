"""Fixtures of the `gpu` tests: a small model with Qwen2.5-7B's attention heads on CUDA and the actor's config.

Every test module here is marked `gpu` and skips without CUDA, saying so (`pytest -m gpu --collect-only` lists
them anywhere). They run on one GPU in a few minutes (`make gpu-check` runs them first).
"""
from __future__ import annotations

import pytest
import torch

# Qwen2.5-7B's attention (28 query heads, 4 key/value heads of 128) on a narrow, shallow body.
GQA_SHAPE = {"vocab_size": 4096, "hidden_size": 3584, "intermediate_size": 1024, "num_hidden_layers": 2,
             "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 4096,
             "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@pytest.fixture(scope="session")
def gqa_model_path(tiny_model_path, tmp_path_factory) -> str:
    """A random-weight bf16 checkpoint of GQA_SHAPE with the tiny model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gqa_model")
    Qwen2ForCausalLM._from_config(Qwen2Config(**GQA_SHAPE), torch_dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out)
    return str(out)


def actor_config(model_path: str, *overrides: str):
    """The ``actor_rollout_ref`` block of ppo_trainer.yaml for ``model_path`` with ``overrides`` (key=value)."""
    from verl.trainer.config_schema import compose_config

    return compose_config([f"actor_rollout_ref.model.path={model_path}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.entropy_coeff=0.001",
                           "actor_rollout_ref.rollout.prompt_length=64", "actor_rollout_ref.rollout.response_length=192",
                           *overrides]).actor_rollout_ref


@pytest.fixture(scope="session")
def actor_config_factory():
    """:func:`actor_config`, for the tests."""
    return actor_config


def dialogue_batch(rows: int, vocab: int, prompt: int = 64, response: int = 192, seed: int = 0):
    """An update batch of mixed lengths: left-padded prompts, right-padded responses with a user-turn span
    (``response_mask`` 0) inside, advantages and (stand-in) old log-probs."""
    from verl.protocol import DataProto

    gen = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(8, prompt + 1, (rows,), generator=gen)
    r_lens = torch.randint(16, response + 1, (rows,), generator=gen)
    prompt_mask = (torch.arange(prompt)[None] >= prompt - p_lens[:, None]).long()
    response_attn = (torch.arange(response)[None] < r_lens[:, None]).long()
    response_mask = response_attn.clone()
    response_mask[:, 5:12] = 0  # a user turn: attended, no loss
    ids = torch.randint(4, vocab, (rows, prompt + response), generator=gen)
    attention = torch.cat([prompt_mask, response_attn], dim=1)
    ids = torch.where(attention.bool(), ids, torch.full_like(ids, 3))
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": attention, "position_ids": positions, "responses": ids[:, prompt:],
        "response_mask": response_mask, "advantages": torch.randn(rows, response, generator=gen) * response_mask,
    }, meta_info={"temperature": 1.0})


@pytest.fixture(scope="session")
def dialogue_batch_factory():
    """:func:`dialogue_batch`, for the tests."""
    return dialogue_batch
