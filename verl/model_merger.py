"""Export an HF model (or a LoRA adapter) from a checkpoint: ``python -m verl.model_merger``.

Checkpoints saved with ``trainer.save_hf_model=last|never`` hold the model only as a torch.distributed.checkpoint
(``sharded_state/``, written by every rank) plus ``config.json`` and the tokenizer. This command reads the model
part of that state in one process (no GPUs, no process group; any world size it was saved with), builds the HF
model from ``config.json`` and writes a ``save_pretrained`` directory (safetensors) in the chosen dtype::

    python -m verl.model_merger --local_dir checkpoints/sead/run/global_step_40/actor --target_dir hf/step40 \\
        [--dtype bf16|fp16|fp32] [--adapter_only] [--base_model DIR] [--trust_checkpoint]

A LoRA checkpoint (``adapter_config.json`` in ``--local_dir``; its adapter from ``adapter_model.safetensors`` or,
without that export, from ``sharded_state/``) is exported merged by default: the base model (``--base_model``, else
the adapter config's ``base_model_name_or_path``) with W + alpha / r * B @ A in every adapted layer (PEFT's
``merge_and_unload``), loadable with ``AutoModelForCausalLM.from_pretrained``; with ``--adapter_only`` as the
adapter alone in PEFT's format (``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load it).

Exports keep the training dtype unless ``--dtype`` asks for another: the checkpoint's own (float32 master) weights,
a LoRA model merged in float32. A narrower ``--dtype`` halves the files but rounds every weight: a small adapter's
whole change can vanish in bf16's rounding of the merged weights, so a merged LoRA export in bf16 or fp16 measures
that rounding against the adapter's change and warns when it is not small. The weight files get the mode the
umask gives the files beside them.

Opening a checkpoint runs none of its contents as code and trusts none of its sizes: the directory is verified
against its ``checkpoint_manifest.json`` first (one without a manifest only with ``--trust_checkpoint``), the
sharded state is read by :mod:`verl.utils.safe_dcp`, and ``config.json`` must describe a model whose tensors have
exactly the names and shapes found (:mod:`verl.utils.model_config_check`) before any weight is allocated.
"""
from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from verl.utils.checkpoint_manifest import verify_checkpoint
from verl.utils.file_modes import weights_like_the_rest
from verl.utils.fsdp_utils import SHARDED_STATE_DIR
from verl.utils.lora import (ADAPTER_NAME, ADAPTER_WEIGHTS_FILE, is_adapter_dir, read_adapter_config, save_adapter)
from verl.utils.model_config_check import check_shapes, meta_model, model_class, read_model_config
from verl.utils.safe_dcp import load_dcp, read_dcp_metadata

logger = logging.getLogger(__name__)

__all__ = ["DTYPES", "TRUST_FLAG", "checkpoint_tensors", "load_adapter", "load_model_weights", "merge",
           "merged_lora_model", "read_tensors"]

TRUST_FLAG = "--trust_checkpoint"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "chat_template.jinja", "added_tokens.json", "generation_config.json")


def checkpoint_tensors(local_dir: str | Path, trust_unverified: bool = False, flag: str = TRUST_FLAG
                       ) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{name: (shape, dtype)} of the model tensors in `local_dir/sharded_state` (a LoRA checkpoint's: its trainable
    parameters under the PEFT model's names) from its checked metadata, nothing allocated. `local_dir` is first
    verified against its manifest (`trust_unverified`: one without a manifest is opened anyway; `flag` names that
    option in the refusal)."""
    local = Path(local_dir)
    ckpt = local / SHARDED_STATE_DIR
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt} does not exist: {local_dir} is not an actor/ or critic/ checkpoint "
                                "directory written by the trainer")
    verify_checkpoint(local, trust_unverified, flag)
    metadata = read_dcp_metadata(ckpt)
    tensors = {fqn[len("model."):]: (meta.size, meta.properties.dtype)
               for fqn, meta in metadata.state_dict_metadata.items()
               if fqn.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    if not tensors:
        raise ValueError(f"{ckpt} holds no model tensors (keys start with 'model.')")
    return tensors


def read_tensors(local_dir: str | Path, tensors: Mapping[str, tuple[torch.Size, torch.dtype]],
                 expected: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """The weights `tensors` (from :func:`checkpoint_tensors`) read from `local_dir/sharded_state` in this process by
    :mod:`verl.utils.safe_dcp` (nothing in the files runs as code). With `expected` ({name: shape} of the model
    they are for), names and shapes must match before anything is allocated."""
    if expected is not None:
        check_shapes(local_dir, {name: size for name, (size, _) in tensors.items()}, expected)
    model = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in tensors.items()}
    load_dcp({"model": model}, Path(local_dir) / SHARDED_STATE_DIR, alone=True)
    return model


def load_model_weights(local_dir: str | Path, trust_unverified: bool = False, flag: str = TRUST_FLAG
                       ) -> tuple[Any, torch.nn.Module, dict[str, torch.Tensor]]:
    """(config, its model on the meta device, the weights) of a full-weights checkpoint: config.json is checked
    against the sharded state's tensors (:mod:`verl.utils.model_config_check`) before they are read."""
    local = Path(local_dir)
    tensors = checkpoint_tensors(local, trust_unverified, flag)
    config = read_model_config(local, len(tensors))
    skeleton = meta_model(config, local)
    expected = {name: tuple(value.shape) for name, value in skeleton.state_dict().items()}
    return config, skeleton, read_tensors(local, tensors, expected)


def _base_dir(local: Path, config: dict[str, Any], base_model: str | Path | None) -> Path:
    """The base model directory of a LoRA checkpoint: ``base_model`` or the adapter config's record."""
    base = Path(base_model or config.get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{local}: the LoRA adapter's base model {str(base)!r} is no local model directory "
                                "(config.json); pass --base_model DIR")
    return base


def _peft_skeleton(local: Path, config: dict[str, Any], base_model: str | Path | None) -> torch.nn.Module:
    """A PEFT model of the checkpoint's shape on the meta device (names only)."""
    from peft import LoraConfig, get_peft_model

    own = (local / "config.json").is_file()  # a checkpoint's actor/ holds its base model's config
    source = local if own else _base_dir(local, config, base_model)
    skeleton = meta_model(read_model_config(source), source)  # an adapter's tensors need not cover every layer
    return get_peft_model(skeleton, LoraConfig.from_pretrained(str(local)))


def load_adapter(local_dir: str | Path, base_model: str | Path | None = None, trust_unverified: bool = False,
                 flag: str = TRUST_FLAG) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter config, adapter tensors under PEFT's saved names) of a LoRA checkpoint or adapter directory (a
    checkpoint's `sharded_state/` verified and read by :func:`checkpoint_tensors` and :func:`read_tensors`)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    local = Path(local_dir)
    config = read_adapter_config(local)
    if (local / ADAPTER_WEIGHTS_FILE).is_file():
        return config, load_file(str(local / ADAPTER_WEIGHTS_FILE))
    shapes = checkpoint_tensors(local, trust_unverified, flag)
    skeleton = _peft_skeleton(local, config, base_model)
    expected = {name: tuple(value.shape) for name, value in skeleton.state_dict().items() if name in shapes}
    state = read_tensors(local, shapes, expected)
    tensors = get_peft_model_state_dict(skeleton, state_dict=state, adapter_name=ADAPTER_NAME,
                                        save_embedding_layers=False)
    if len(tensors) != len(state):
        raise ValueError(f"{local}: {len(state) - len(tensors)} of the {len(state)} tensors of {SHARDED_STATE_DIR}/ "
                         f"are no part of its adapter (adapter_config.json)")
    return config, tensors


def merged_lora_model(local_dir: str | Path, dtype: torch.dtype = torch.float32,
                      base_model: str | Path | None = None, trust_unverified: bool = False,
                      flag: str = TRUST_FLAG) -> torch.nn.Module:
    """The HF model of a LoRA checkpoint or adapter directory: its base model with the adapter merged in."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import set_peft_model_state_dict

    local = Path(local_dir)
    config, tensors = load_adapter(local, base_model, trust_unverified, flag)
    base = _base_dir(local, config, base_model)
    hf_config = read_model_config(local if (local / "config.json").is_file() else base)  # a critic's class
    model = model_class(hf_config).from_pretrained(str(base), config=hf_config, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig.from_pretrained(str(local)))
    result = set_peft_model_state_dict(peft_model, tensors, adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{local}: the adapter does not fit its base model {base}: unexpected "
                         f"{sorted(result.unexpected_keys)[:4]}, missing {sorted(missing)[:4]}")
    if dtype.itemsize < 4:
        _warn_if_rounding_erases(peft_model, dtype, local)
    return peft_model.merge_and_unload().to(dtype)


def adapter_rounding(peft_model: torch.nn.Module, dtype: torch.dtype) -> float:
    """How much casting the merged weights W + dW to `dtype` moves them, relative to the adapter's own change:
    ||cast(W + dW) - (W + dW)|| / ||dW|| over every adapted layer (Frobenius norms; inf for a zero adapter)."""
    from peft.tuners.lora import LoraLayer

    moved = change = 0.0
    with torch.no_grad():
        for module in peft_model.modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                delta = module.get_delta_weight(ADAPTER_NAME).float()
                merged = module.get_base_layer().weight.float() + delta
                moved += float((merged.to(dtype).float() - merged).square().sum())
                change += float(delta.square().sum())
    return moved ** 0.5 / change ** 0.5 if change > 0 else float("inf")


def _warn_if_rounding_erases(peft_model: torch.nn.Module, dtype: torch.dtype, local: Path) -> None:
    ratio = adapter_rounding(peft_model, dtype)
    if ratio > 0.1:
        logger.warning("%s: casting the merged weights to %s moves them by %.2f times the adapter's whole change "
                       "(||rounding|| / ||dW||): the export blurs what the adapter learnt; export in float32 (the "
                       "default) or the adapter alone (--adapter_only)", local, dtype, ratio)


def merge(local_dir: str | Path, target_dir: str | Path, dtype: str | None = None, adapter_only: bool = False,
          base_model: str | Path | None = None, trust_unverified: bool = False) -> Path:
    """Write the HF model of checkpoint directory `local_dir` to `target_dir` in `dtype` (default: the training
    dtype, the weights as the checkpoint holds them; a LoRA checkpoint merged in float32, or with `adapter_only`
    its adapter as saved); returns target_dir. `trust_unverified` opens a checkpoint that has no manifest
    (--trust_checkpoint)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    local, target = Path(local_dir), Path(target_dir)
    lora = is_adapter_dir(local)
    if adapter_only and not lora:
        raise ValueError(f"--adapter_only: {local} holds no LoRA adapter (adapter_config.json)")
    if lora:
        cast_to = DTYPES[dtype or "fp32"]
        if adapter_only:
            config, tensors = load_adapter(local, base_model, trust_unverified)
            save_adapter(target, {k: v.to(cast_to) if v.is_floating_point() else v for k, v in tensors.items()},
                         config)
            written = len(tensors)
        else:
            model = merged_lora_model(local, cast_to, base_model, trust_unverified)
            written = len(model.state_dict())
            target.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(target), safe_serialization=True)
    else:
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{local / 'config.json'} is missing: cannot tell which model to build")
        cast_to = DTYPES[dtype] if dtype else None  # None: as trained (the float32 master weights)
        _, skeleton, weights = load_model_weights(local, trust_unverified)
        cast = {k: v.to(cast_to) if cast_to is not None and v.is_floating_point() else v for k, v in weights.items()}
        written = len(cast)  # save_pretrained empties the dict it is given
        target.mkdir(parents=True, exist_ok=True)
        skeleton.save_pretrained(str(target), state_dict=cast, safe_serialization=True)
    weights_like_the_rest(target)
    for name in _TOKENIZER_FILES:
        if (local / name).is_file():
            shutil.copy2(local / name, target / name)
    logger.info("wrote %s (%d tensors, %s%s) from %s", target, written, cast_to or "the training dtype",
                ", LoRA adapter" if adapter_only else ", LoRA merged" if lora else "", local)
    return target


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--local_dir", required=True, help="a checkpoint's actor/ (or critic/) directory")
    parser.add_argument("--target_dir", required=True, help="where to write the HF model")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="dtype of the exported weights (default: the training dtype, as the checkpoint holds "
                             "them; a merged LoRA model: fp32)")
    parser.add_argument("--adapter_only", action="store_true",
                        help="a LoRA checkpoint: write the adapter alone (PEFT format) instead of the merged model")
    parser.add_argument("--base_model", default=None,
                        help="a LoRA checkpoint's base model directory (default: the one its adapter config names)")
    parser.add_argument(TRUST_FLAG, action="store_true",
                        help="open a checkpoint that has no checkpoint_manifest.json (from elsewhere, or saved before "
                             "manifests): say so only if you trust where it came from (docs/checkpoints.md)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(merge(args.local_dir, args.target_dir, args.dtype, args.adapter_only, args.base_model,
                    args.trust_checkpoint))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"model_merger: {exc}") from None


if __name__ == "__main__":
    main()
