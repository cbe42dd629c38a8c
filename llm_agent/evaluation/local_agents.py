"""Local policy agents: a model directory or a training checkpoint generating through the trainer's rollout engines.

Both are `verl.workers.rollout.engine.RolloutEngine`s (policy version 0: a fixed model), so the rollout loop drives
them exactly as it drives the trainer's policy, with the same sampling semantics (greedy unless the batch's
`meta_info` samples, the loop's `response_length`, `eos_token_id` and `pad_token_id`):

- `HFRolloutAgent`: `verl.workers.rollout.hf_rollout.HFRollout` (transformers `generate`) on the model.
- `VLLMRolloutAgent`: `verl.workers.rollout.vllm_rollout.vLLMRollout`, the trainer's colocated vLLM engine, built
  the way an actor-rollout worker builds it (a world-size-1 process group, an engine with dummy weights, then the
  policy's weights streamed in memory by `fsdp_weight_stream`); token ids in, token ids out.

The weights come from the directory's HF export (`save_pretrained` files) or, for a checkpoint saved without one
(`trainer.save_hf_model=last|never`), from its `sharded_state/` read by `verl.model_merger.load_model_weights`; no
export is written. A LoRA checkpoint or adapter directory (`adapter_config.json`: a LoRA run's `actor/`, or
`python -m verl.model_merger --adapter_only`'s output) is its base model with the adapter merged in
(`verl.model_merger.merged_lora_model`). A trainer checkpoint is verified against its manifest first and its
sharded state read without running code (docs/checkpoints.md; `--trust-checkpoint` opens one without a manifest).
`pick_engine("auto")` is vLLM when it is importable, HF otherwise.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llm_agent.evaluation.defaults import ENGINES
from verl.model_merger import load_model_weights, merged_lora_model
from verl.protocol import DataProto
from verl.utils.checkpoint import find_latest_checkpoint
from verl.utils.checkpoint_manifest import MANIFEST_FILE, verify_checkpoint
from verl.utils.dataset import load_tokenizer
from verl.utils.device import get_device_name, get_dist_backend
from verl.utils.fsdp_utils import SHARDED_STATE_DIR
from verl.utils.lora import ADAPTER_WEIGHTS_FILE, is_adapter_dir, read_adapter_config
from verl.workers.rollout.engine import RolloutEngine, TextStreaming
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.vllm_rollout import vllm_available

logger = logging.getLogger(__name__)

__all__ = ["ENGINES", "DecodedPieces", "HFRolloutAgent", "VLLMRolloutAgent", "load_policy_model", "pick_engine",
           "resolve_model_dir"]

TRUST_FLAG = "--trust-checkpoint"  # evaluate.py's option opening a checkpoint without a manifest
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


def _is_model_dir(path: Path) -> bool:
    """A model directory (config.json) or a LoRA adapter (adapter_config.json)."""
    return (path / "config.json").is_file() or is_adapter_dir(path)


def resolve_model_dir(path: str | Path) -> Path:
    """The HF model (or LoRA adapter) directory behind `path`: itself, its `actor/` (a `global_step_N`
    checkpoint), or the latest complete checkpoint's `actor/` (a checkpoint root); ValueError naming the path
    otherwise."""
    root = Path(path)
    if _is_model_dir(root):
        return root
    if _is_model_dir(root / "actor"):
        return root / "actor"
    latest = find_latest_checkpoint(root) if root.is_dir() else None
    if latest is not None and _is_model_dir(latest / "actor"):
        return latest / "actor"
    raise ValueError(f"{path}: not a model directory (no config.json), a LoRA adapter (adapter_config.json), a "
                     "checkpoint with either in actor/, or a checkpoint root with a complete global_step_N")


def base_dir(model_dir: Path) -> Path:
    """Where the model's config and tokenizer are: `model_dir`, or for an adapter without them its base model."""
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer_config.json").is_file():
        return model_dir
    if is_adapter_dir(model_dir):
        return Path(read_adapter_config(model_dir).get("base_model_name_or_path") or model_dir)
    return model_dir


def pick_engine(engine: str) -> str:
    """`hf` or `vllm` for an `--engine` choice (`auto`: vllm when importable); ValueError for an unknown or
    unavailable one."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        return "vllm" if vllm_available() else "hf"
    if engine == "vllm" and not vllm_available():
        raise ValueError("engine vllm: vLLM is not installed in this Python environment (make vllm-env builds one "
                         "with it); use --engine hf")
    return engine


def policy_dtype(device: str) -> torch.dtype:
    """The compute dtype the trainer's actor uses on `device` (its `param_dtype: auto`): bf16 on CUDA, fp32 else."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def is_checkpoint_dir(path: Path) -> bool:
    """A trainer checkpoint's actor/ (or critic/): it has a sharded state or a checkpoint manifest."""
    return (path / SHARDED_STATE_DIR).is_dir() or (path / MANIFEST_FILE).is_file()


def load_policy_model(model_dir: Path, dtype: torch.dtype, device: str = "cpu", trust_unverified: bool = False
                      ) -> torch.nn.Module:
    """The causal LM of `model_dir` in `dtype` on `device`, from its HF weight files, its `sharded_state/`
    (a checkpoint saved without the HF export) or, for a LoRA adapter, its base with the adapter merged;
    ValueError naming the directory when it has none of them. A checkpoint is verified against its manifest
    before it is read (`trust_unverified`: one without a manifest is read anyway; --trust-checkpoint)."""
    from transformers import AutoModelForCausalLM

    hf_weights = any((model_dir / name).is_file() for name in HF_WEIGHT_FILES)
    adapter = is_adapter_dir(model_dir)
    reads_sharded = not ((model_dir / ADAPTER_WEIGHTS_FILE).is_file() if adapter else hf_weights)
    if is_checkpoint_dir(model_dir) and not reads_sharded:  # the sharded state's reader verifies it itself
        verify_checkpoint(model_dir, trust_unverified, TRUST_FLAG)
    if adapter:
        try:
            model = merged_lora_model(model_dir, dtype, trust_unverified=trust_unverified, flag=TRUST_FLAG)
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
        logger.info("loaded %s: its base model with the LoRA adapter merged", model_dir)
        return model.to(device)
    if hf_weights:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    if not (model_dir / SHARDED_STATE_DIR).is_dir():
        raise ValueError(f"{model_dir}: no model weights ({', '.join(HF_WEIGHT_FILES)}) and no {SHARDED_STATE_DIR}/ "
                         "of a trainer checkpoint")
    config, _, weights = load_model_weights(model_dir, trust_unverified, TRUST_FLAG)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}, strict=True)
    logger.info("loaded %s from %s/ (%d tensors; no HF export in the checkpoint)", model_dir, SHARDED_STATE_DIR,
                len(weights))
    return model.to(device)


class DecodedPieces:
    """A token listener that hands the text of the tokens to a text listener in pieces, as they are decoded
    (`skip_special_tokens`); text the next token may still change (a character's first bytes, trailing spaces a
    tokenizer's clean-up may drop) is held back until it is settled or the generation ends."""

    def __init__(self, tokenizer: Any, listener: Callable[[str | None], None]) -> None:
        self.tokenizer, self.listener = tokenizer, listener
        self.ids: list[int] = []
        self.sent = ""

    def _emit(self, text: str) -> None:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.listener(text[len(self.sent):])
            self.sent = text

    def __call__(self, token: int | None) -> None:
        if token is not None:
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self._emit(text.rstrip().rstrip("\ufffd"))
            return
        if self.ids:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if not text.startswith(self.sent):  # the decoder rewrote settled text: the page keeps what it got
                logger.warning("a streamed turn's decoded text changed after it was shown")
            self._emit(text)
        self.ids, self.sent = [], ""
        self.listener(None)


class HFRolloutAgent(RolloutEngine, TextStreaming):
    """A local model generating through the trainer's `HFRollout` (greedy unless the batch's meta_info samples)."""

    def __init__(self, model_dir: str | Path, micro_batch_size: int | None = None, device: str | None = None,
                 trust_unverified: bool = False):
        self.model_dir = resolve_model_dir(model_dir)
        self.device = device or get_device_name()
        dtype = policy_dtype(self.device)
        model = load_policy_model(self.model_dir, dtype, self.device, trust_unverified)  # verified before all else
        self.tokenizer = load_tokenizer(str(base_dir(self.model_dir)))
        self.rollout = HFRollout(model, OmegaConf.create({"micro_batch_size_per_gpu": micro_batch_size,
                                                          "do_sample": False}))
        logger.info("agent %s: HFRollout on %s (%s)", self.model_dir, self.device, dtype)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """HFRollout's `generate_sequences` on this process's model."""
        return self.rollout.generate_sequences(prompts)

    def stream_text(self, listener: Callable[[str | None], None] | None) -> None:
        """Hand the decoded text of a one-row generation to `listener` in pieces (None after the last); None:
        stop."""
        self.rollout.token_listener = None if listener is None else DecodedPieces(self.tokenizer, listener)


def _join_single_rank_group(device: str) -> bool:
    """Make this process rank 0 of a world-size-1 torch.distributed group, as an actor-rollout worker is (vLLM's
    external launcher joins it); True when this call created the group."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"VLLMRolloutAgent runs in one process, but torch.distributed is initialised with "
                               f"{dist.get_world_size()} ranks")
        return False
    from llm_agent.evaluation.sims import free_port

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    dist.init_process_group(get_dist_backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


class VLLMRolloutAgent(RolloutEngine):
    """A local model generating through the trainer's `vLLMRollout` (see the module docstring).

    `max_model_len` bounds prompt + dialogue tokens (the evaluation's max_prompt_length + max_response_length);
    `gpu_memory_utilization` is vLLM's share of the GPU (the engine does not sleep: nothing else trains here).
    One engine per process at a time: `close()` shuts it down and leaves the process group it created.
    """

    def __init__(self, model_dir: str | Path, max_model_len: int, gpu_memory_utilization: float = 0.8,
                 max_num_seqs: int = 256, device: str | None = None, seed: int = 0, trust_unverified: bool = False):
        from verl.workers.rollout.vllm_rollout import WeightSyncStats, fsdp_weight_stream, vLLMRollout

        self.rollout: vLLMRollout | None = None

        self.model_dir = resolve_model_dir(model_dir)
        self.device = device or get_device_name()
        dtype = policy_dtype(self.device)
        model = load_policy_model(self.model_dir, dtype, "cpu", trust_unverified)  # verified before all else
        self.tokenizer = load_tokenizer(str(base_dir(self.model_dir)))
        self._owns_group = _join_single_rank_group(self.device)
        config = OmegaConf.create({
            "tensor_model_parallel_size": 1, "gpu_memory_utilization": gpu_memory_utilization,
            "max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "enforce_eager": True,
            "enable_prefix_caching": True, "seed": seed, "free_cache_engine": False, "calculate_log_probs": False,
            "do_sample": False})
        try:
            self.rollout = vLLMRollout(str(base_dir(self.model_dir)), config, str(dtype).removeprefix("torch."),
                                       self.device)
            stats = WeightSyncStats()
            stream = ((name, tensor.to(self.device)) for name, tensor in fsdp_weight_stream(model, dtype, stats))
            self.rollout.update_weights(stream, stats)
        except BaseException:
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()
            raise
        del model
        logger.info("agent %s: vLLMRollout on %s (%s), %d tensors (%.1f MiB) loaded in %.2f s", self.model_dir,
                    self.device, dtype, stats.tensors, stats.bytes / 2**20, stats.seconds)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """vLLMRollout's `generate_sequences` on this process's engine."""
        return self.rollout.generate_sequences(prompts)

    def close(self) -> None:
        """Shut the engine down and, if this agent created it, leave the process group (vLLM's cleanup)."""
        if self.rollout is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.rollout = None
        gc.collect()
        if self._owns_group:
            cleanup_dist_env_and_memory()
