"""Export an HF model from a checkpoint's sharded state: ``python -m verl.model_merger``.

Checkpoints saved with ``trainer.save_hf_model=last|never`` hold the model only as a torch.distributed.checkpoint
(``sharded_state/``, written by every rank) plus ``config.json`` and the tokenizer. This command reads the model
part of that state in one process (no GPUs, no process group; any world size it was saved with), builds the HF
model from ``config.json`` and writes a ``save_pretrained`` directory (safetensors) in the chosen dtype::

    python -m verl.model_merger --local_dir checkpoints/sead/run/global_step_40/actor --target_dir hf/step40 \\
        [--dtype bf16|fp16|fp32]
"""
from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from verl.utils.fsdp_utils import SHARDED_STATE_DIR

logger = logging.getLogger(__name__)

__all__ = ["DTYPES", "load_model_state", "merge"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "chat_template.jinja", "added_tokens.json", "generation_config.json")


def load_model_state(local_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of `local_dir/sharded_state`, read in this process."""
    ckpt = Path(local_dir) / SHARDED_STATE_DIR
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt} does not exist: {local_dir} is not an actor/ or critic/ checkpoint "
                                "directory written by the trainer")
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata()
    model = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[fqn[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ValueError(f"{ckpt} holds no model tensors (keys start with 'model.')")
    state = {"model": model}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    return state["model"]


def _model_class(config) -> type:
    """The transformers class named by config.architectures."""
    import transformers

    names = getattr(config, "architectures", None) or []
    if not names or not hasattr(transformers, names[0]):
        raise ValueError(f"config.json names no transformers class in 'architectures' ({names!r})")
    return getattr(transformers, names[0])


def merge(local_dir: str | Path, target_dir: str | Path, dtype: str = "bf16") -> Path:
    """Write the HF model of checkpoint directory `local_dir` to `target_dir` in `dtype`; returns target_dir."""
    from transformers import AutoConfig

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    local, target = Path(local_dir), Path(target_dir)
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"{local / 'config.json'} is missing: cannot tell which model to build")
    config = AutoConfig.from_pretrained(local)
    weights = load_model_state(local)
    with torch.device("meta"):
        skeleton = _model_class(config)._from_config(config)
    expected = set(skeleton.state_dict())
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(f"{local}: the sharded state does not match config.json's model: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    cast = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in weights.items()}
    target.mkdir(parents=True, exist_ok=True)
    skeleton.save_pretrained(str(target), state_dict=cast, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (local / name).is_file():
            shutil.copy2(local / name, target / name)
    logger.info("wrote %s (%d tensors, %s) from %s", target, len(cast), dtype, local)
    return target


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dir", required=True, help="a checkpoint's actor/ (or critic/) directory")
    parser.add_argument("--target_dir", required=True, help="where to write the HF model")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the exported weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(merge(args.local_dir, args.target_dir, args.dtype))
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"model_merger: {exc}") from None


if __name__ == "__main__":
    main()
