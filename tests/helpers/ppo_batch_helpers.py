"""Shared builders for the worker tests: a deterministic PPO batch for the tiny model and an actor config."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from verl.protocol import DataProto

PROMPT_LEN = 10
RESPONSE_LEN = 6


def make_prompts(batch_size: int, vocab_size: int, seed: int = 0) -> DataProto:
    """Left-padded random prompts (rows have 3..PROMPT_LEN real tokens) with masks and position ids."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab_size, (batch_size, PROMPT_LEN), generator=gen)
    lengths = torch.randint(3, PROMPT_LEN + 1, (batch_size,), generator=gen)
    attention_mask = (torch.arange(PROMPT_LEN).unsqueeze(0) >= PROMPT_LEN - lengths.unsqueeze(1)).long()
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, 3))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    )


def make_ppo_batch(batch_size: int, vocab_size: int, seed: int = 0) -> DataProto:
    """A full update batch: prompts + random responses of varying length, advantages and fake old log-probs."""
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = make_prompts(batch_size, vocab_size, seed).batch
    responses = torch.randint(4, vocab_size, (batch_size, RESPONSE_LEN), generator=gen)
    lengths = torch.randint(1, RESPONSE_LEN + 1, (batch_size,), generator=gen)
    response_mask = (torch.arange(RESPONSE_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, 3))
    last_pos = prompts["position_ids"][:, -1:]
    tensors = {
        "prompts": prompts["input_ids"],
        "responses": responses,
        "input_ids": torch.cat([prompts["input_ids"], responses], dim=1),
        "attention_mask": torch.cat([prompts["attention_mask"], response_mask], dim=1),
        "position_ids": torch.cat([prompts["position_ids"], last_pos + torch.arange(1, RESPONSE_LEN + 1)], dim=1),
        "response_mask": response_mask,
        "advantages": torch.randn(batch_size, RESPONSE_LEN, generator=gen) * response_mask,
        "old_log_probs": -7.0 + 0.3 * torch.randn(batch_size, RESPONSE_LEN, generator=gen),
        "ref_log_prob": -7.0 + 0.3 * torch.randn(batch_size, RESPONSE_LEN, generator=gen),
        "returns": torch.randn(batch_size, RESPONSE_LEN, generator=gen) * response_mask,
        "values": 0.1 * torch.randn(batch_size, RESPONSE_LEN, generator=gen) * response_mask,
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})


def actor_config(**overrides) -> DictConfig:
    """An actor config block (ppo_mini_batch_size already in rows per rank) with the given overrides."""
    base = {
        "strategy": "fsdp2",
        "ppo_mini_batch_size": 4,
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_epochs": 1,
        "shuffle": False,
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "kl_loss_type": "low_var_kl",
        "grad_clip": 1.0,
        "optim": {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "lr_warmup_steps": -1,
                  "lr_warmup_steps_ratio": 0.0, "warmup_style": "constant", "min_lr_ratio": 0.0,
                  "total_training_steps": 10},
        "fsdp_config": {"param_dtype": "auto", "reshard_after_forward": True},
        "seed": 42,
    }  # fmt: skip
    cfg = OmegaConf.create(base)
    return OmegaConf.merge(cfg, OmegaConf.create(overrides))


def actor_rollout_ref_config(model_path: str, **actor_overrides) -> DictConfig:
    """A ``cfg.actor_rollout_ref`` block for the tiny model."""
    return OmegaConf.create(
        {
            "model": {"path": model_path, "tokenizer_path": None, "enable_gradient_checkpointing": False,
                      "attn_implementation": "sdpa"},
            "actor": actor_config(**actor_overrides),
            "ref": {"log_prob_micro_batch_size_per_gpu": 4},
            "rollout": {"name": "hf", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": True, "n": 1,
                        "prompt_length": 10, "response_length": RESPONSE_LEN, "log_prob_micro_batch_size_per_gpu": 4,
                        "micro_batch_size_per_gpu": 4},
        }
    )  # fmt: skip


def critic_config(model_path: str, strategy: str = "fsdp2") -> DictConfig:
    """A ``cfg.critic`` block for the tiny model."""
    return OmegaConf.create(
        {
            "strategy": strategy,
            "model": {"path": model_path, "enable_gradient_checkpointing": True},
            "optim": {"lr": 1e-2, "weight_decay": 0.0, "betas": [0.9, 0.999], "lr_warmup_steps": 0},
            "rollout_n": 1, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4,
            "forward_micro_batch_size_per_gpu": 3, "ppo_epochs": 1, "shuffle": False, "cliprange_value": 100.0,
            "loss_agg_mode": "token-mean", "grad_clip": 1.0,
            "fsdp_config": {"param_dtype": "auto", "reshard_after_forward": True},
        }
    )  # fmt: skip


def make_dialogue_batch(
    batch_size: int, vocab_size: int, prompt_len: int = 12, response_len: int = 24, seed: int = 0
) -> DataProto:
    """A multi-turn-like update batch of mixed lengths: left-padded prompts (2..prompt_len tokens), right-padded
    responses (1..response_len tokens) whose ``response_mask`` is 0 on up to two user-turn spans inside the
    response, and one row without any loss token."""
    gen = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(2, prompt_len + 1, (batch_size,), generator=gen)
    r_lens = torch.randint(1, response_len + 1, (batch_size,), generator=gen)
    r_lens[0] = response_len  # one full-length response
    prompt_mask = (torch.arange(prompt_len).unsqueeze(0) >= prompt_len - p_lens.unsqueeze(1)).long()
    attended = (torch.arange(response_len).unsqueeze(0) < r_lens.unsqueeze(1)).long()
    response_mask = attended.clone()
    for row in range(batch_size):
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
            start = int(torch.randint(0, response_len, (1,), generator=gen))
            response_mask[row, start : start + int(torch.randint(1, 6, (1,), generator=gen))] = 0
    response_mask[-1] = 0  # e.g. a padding row of the DP dispatch
    attention_mask = torch.cat([prompt_mask, attended], dim=1)
    input_ids = torch.randint(4, vocab_size, attention_mask.shape, generator=gen)
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, 3))
    shape = (batch_size, response_len)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, prompt_len:].clone(),
        "response_mask": response_mask,
        "advantages": torch.randn(shape, generator=gen) * response_mask,
        "old_log_probs": -7.0 + 0.3 * torch.randn(shape, generator=gen),
        "ref_log_prob": -7.0 + 0.3 * torch.randn(shape, generator=gen),
        "returns": torch.randn(shape, generator=gen) * response_mask,
        "values": 0.1 * torch.randn(shape, generator=gen) * response_mask,
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})
