"""HFRollout: single-turn generation with HF ``generate`` directly on the (FSDP1/FSDP2-sharded) actor model."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tensordict import TensorDict
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from verl.protocol import DataProto
from verl.utils.fsdp_utils import generation_model, unwrap_model
from verl.utils.torch_functional import get_response_mask
from verl.workers.batching import select_batch
from verl.workers.rollout.engine import RolloutEngine
from verl.workers.rollout.hf_logprobs import SampledTokenLogProbs

logger = logging.getLogger(__name__)

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def sampling_setting(meta_info: dict[str, Any], config: Any, key: str, default: Any) -> Any:
    """A sampling setting of one call: ``meta_info[key]`` if given, else the rollout ``config[key]``, else
    ``default`` (shared by every rollout engine, so they read per-call overrides identically)."""
    if meta_info.get(key) is not None:
        return meta_info[key]
    value = config.get(key, None)
    return default if value is None else value


def check_left_padded(attention_mask: torch.Tensor) -> None:
    """Raise naming the rows whose prompt ends with padding (prompts must be left-padded)."""
    right_padded = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
    if right_padded:
        raise ValueError(
            f"generate_sequences: prompts must be left-padded (last attention_mask column 1), but rows "
            f"{right_padded[:8]} end with padding; tokenize with padding_side='left'"
        )


def generation_tensors(input_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_positions: torch.Tensor,
                       responses: torch.Tensor, eos: Any, pad: int) -> dict[str, torch.Tensor]:
    """The generation-batch tensors from left-padded prompts and (B, R) generated ids: the response mask (1 up to
    and including the first EOS; `eos` an id or a list of ids), responses padded with `pad` after it, response
    positions continuing the prompt's, and the prompt+response concatenations."""
    response_mask = get_response_mask(responses, eos)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad))
    offsets = torch.arange(1, responses.size(1) + 1, device=responses.device, dtype=prompt_positions.dtype)
    return {
        "prompts": input_ids,
        "responses": responses,
        "input_ids": torch.cat([input_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1),
        "position_ids": torch.cat([prompt_positions, prompt_positions[:, -1:] + offsets.unsqueeze(0)], dim=1),
        "response_mask": response_mask,
    }


class TokenStreamer(BaseStreamer):
    """Hands each generated token id of a one-row ``generate`` (the prompt's are skipped) to ``listener``, then
    None when generation ends."""

    def __init__(self, listener: Callable[[int | None], None]) -> None:
        self.listener, self.prompt_seen = listener, False

    def put(self, value: torch.Tensor) -> None:
        """``generate``'s first call holds the prompt, every later one the new token."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.listener(int(token))

    def end(self) -> None:
        """Generation ended."""
        self.listener(None)


class HFRollout(RolloutEngine):
    """Generate responses for left-padded prompts with ``module.generate`` (veRL's ``HFRollout``), a
    :class:`~verl.workers.rollout.engine.RolloutEngine` on one rank (its ``policy_version`` set by its owner).

    ``config`` is the ``actor_rollout_ref.rollout`` block: ``do_sample``, ``temperature``, ``top_p``, ``top_k``
    (-1 = off), ``response_length``, ``micro_batch_size_per_gpu`` (rows per ``generate`` call; null = all) and
    ``calculate_log_probs`` (add ``rollout_log_probs``: log softmax(logits / temperature) of each sampled token).
    On FSDP2 the weights are gathered once per :meth:`generate_sequences` and kept for all its micro-batches, so
    the KV cache of a micro-batch, not the weights, bounds its size (``python -m verl.trainer.plan`` estimates it).
    The prompt batch's ``meta_info`` overrides the sampling keys per call and must carry ``eos_token_id`` and
    ``pad_token_id`` unless the model's generation config has them. Sampling draws from the global torch RNG,
    so results are reproducible given the torch seed. With ``token_listener`` set, a one-row micro-batch hands
    each token to it as it is generated (:class:`TokenStreamer`; the outputs are unchanged).
    """

    def __init__(self, module: torch.nn.Module, config: DictConfig):
        self.module = module
        self.config = config
        self.token_listener: Callable[[int | None], None] | None = None

    def _setting(self, meta_info: dict[str, Any], key: str, default: Any) -> Any:
        """``meta_info[key]`` if given, else ``config[key]``, else ``default``."""
        return sampling_setting(meta_info, self.config, key, default)

    def _generation_config(self, meta_info: dict[str, Any]) -> tuple[GenerationConfig, int, Any, int]:
        """The HF generation config for a call, plus (response_length, eos_token_id, pad_token_id)."""
        model_gen = getattr(unwrap_model(self.module), "generation_config", None)
        response_length = int(self._setting(meta_info, "response_length", 0))
        if response_length < 1:
            raise ValueError(f"generate_sequences: response_length must be >= 1, got {response_length}")
        eos = meta_info.get("eos_token_id", getattr(model_gen, "eos_token_id", None))
        pad = meta_info.get("pad_token_id", getattr(model_gen, "pad_token_id", None))
        if eos is None or pad is None:
            raise ValueError(
                "generate_sequences: meta_info needs eos_token_id and pad_token_id (the model defines none)"
            )
        do_sample = bool(self._setting(meta_info, "do_sample", True))
        settings: dict[str, Any] = {"do_sample": do_sample, "num_beams": 1}
        if do_sample:
            top_k = int(self._setting(meta_info, "top_k", -1))
            settings.update(
                temperature=float(self._setting(meta_info, "temperature", 1.0)),
                top_p=float(self._setting(meta_info, "top_p", 1.0)),
                top_k=0 if top_k < 0 else top_k,
            )
            if not settings["temperature"] > 0:
                raise ValueError(
                    f"generate_sequences: temperature must be > 0 when sampling, got {settings['temperature']}"
                )
        gen_config = GenerationConfig(
            max_new_tokens=response_length, eos_token_id=eos, pad_token_id=pad, use_cache=True, **settings
        )
        return gen_config, response_length, eos, int(pad)

    @torch.no_grad()
    def _generate_micro_batch(
        self, model: torch.nn.Module, prompts: TensorDict, meta_info: dict[str, Any]
    ) -> TensorDict:
        """Generate for one micro-batch with ``model`` (see :func:`generation_model`) and build the tensors."""
        gen_config, response_length, eos, pad = self._generation_config(meta_info)
        device = next(self.module.parameters()).device
        input_ids = prompts["input_ids"].to(device)
        prompt_mask = prompts["attention_mask"].to(device)
        synced = dist.is_initialized() and dist.get_world_size() > 1
        recorder = None
        if self.config.get("calculate_log_probs", False):
            recorder = SampledTokenLogProbs(float(self._setting(meta_info, "temperature", 1.0)))
        listener = self.token_listener
        streamer = TokenStreamer(listener) if listener is not None and input_ids.size(0) == 1 else None
        output = model.generate(
            input_ids=input_ids, attention_mask=prompt_mask, generation_config=gen_config, synced_gpus=synced,
            logits_processor=LogitsProcessorList([recorder] if recorder is not None else []), streamer=streamer,
        )
        responses = output[:, input_ids.size(1) :]
        log_probs = recorder.log_probs(responses) if recorder is not None else None
        if responses.size(1) < response_length:
            pad_block = responses.new_full((responses.size(0), response_length - responses.size(1)), pad)
            responses = torch.cat([responses, pad_block], dim=1)
        tensors = generation_tensors(input_ids, prompt_mask, prompts["position_ids"].to(device), responses, eos, pad)
        if log_probs is not None:  # 0 after EOS, as vLLM's
            log_probs = torch.nn.functional.pad(log_probs, (0, response_length - log_probs.size(1)))
            tensors["rollout_log_probs"] = log_probs * tensors["response_mask"]
        return TensorDict({k: v.cpu() for k, v in tensors.items()}, batch_size=[input_ids.size(0)])

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate one response per prompt row; returns ``prompts, responses, input_ids, attention_mask,
        position_ids, response_mask`` (+ ``rollout_log_probs`` with ``calculate_log_probs``) with responses
        right-padded to exactly ``response_length``."""
        batch = select_batch(prompts, PROMPT_KEYS, "generate_sequences")
        check_left_padded(batch["attention_mask"])
        micro_batch_size = int(self.config.get("micro_batch_size_per_gpu", None) or batch.batch_size[0])
        was_training = self.module.training
        self.module.eval()
        try:
            with generation_model(self.module) as model:  # FSDP2: gathered once for all micro-batches
                parts = [self._generate_micro_batch(model, micro, prompts.meta_info)
                         for micro in batch.split(micro_batch_size)]
        finally:
            self.module.train(was_training)
        return self.versioned(DataProto(batch=torch.cat(parts, dim=0)))
