"""What every FSDP worker does with its inputs: a resolved copy of its config block, the rows per rank of a
global batch size, meta_info defaults of a call, and the left-padding tokenizer of its model."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from verl.protocol import DataProto

__all__ = ["load_worker_tokenizer", "resolved_copy", "rows_per_rank", "with_meta_defaults"]


def resolved_copy(config: DictConfig, where: str) -> DictConfig:
    """A detached, fully resolved copy of ``config`` (interpolations into the parent config resolved now)."""
    if not isinstance(config, DictConfig):
        raise TypeError(f"{where} must be an OmegaConf DictConfig, got {type(config).__name__}")
    return OmegaConf.create(OmegaConf.to_container(config, resolve=True))


def rows_per_rank(prompts: int, n: int, world_size: int, where: str) -> int:
    """``prompts * n`` rows split over ``world_size`` ranks; raise unless it divides evenly."""
    rows = int(prompts) * int(n)
    if rows < 1 or rows % world_size != 0:
        raise ValueError(f"{where}={prompts} prompts x rollout.n={n} = {rows} rows must be >= 1 and divisible by "
                         f"the DP world size {world_size}")
    return rows // world_size


def with_meta_defaults(data: DataProto, defaults: dict[str, Any]) -> DataProto:
    """A shallow copy of ``data`` whose meta_info falls back to ``defaults`` (given meta_info wins)."""
    meta = {**{k: v for k, v in defaults.items() if v is not None}, **data.meta_info}
    return DataProto(batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info=meta)


def load_worker_tokenizer(model_cfg: DictConfig, model_path: str) -> Any:
    """The left-padding tokenizer of ``model.tokenizer_path`` (default ``model_path``: ``model.path`` or its
    shared-memory copy)."""
    path = model_cfg.get("tokenizer_path", None) or model_path
    return AutoTokenizer.from_pretrained(path, padding_side="left")
