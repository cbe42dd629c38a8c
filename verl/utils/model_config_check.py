"""A model directory's config.json read as outside input, and the model it describes checked against its weights.

A checkpoint's ``config.json`` says which transformers class to build and how large; a reader that trusts it can be
made to build a model of 10^9 hidden units or to import anything its ``architectures`` names. Here the file is
decoded within size and nesting limits, ``architectures`` must name a transformers model class, a model is built
on the meta device only (nothing allocated) with no more layers than the checkpoint has tensors, and the weights
found must have exactly the names and shapes of that model before any of them is read (a LoRA adapter's, of the
names it has). Every refusal is one
ValueError naming the directory.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from verl.utils.untrusted import UntrustedInputError, load_json

__all__ = ["check_shapes", "meta_model", "model_class", "read_model_config"]

MAX_CONFIG_BYTES = 4 << 20  # a model config is a few KB
MAX_LAYERS = 1024  # the deepest released models have under 200
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def read_model_config(directory: str | os.PathLike, n_tensors: int | None = None) -> Any:
    """The transformers config of `directory`/config.json, checked as the module docstring says (`n_tensors`: the
    tensors of the checkpoint of its full weights, an upper bound of its layers; else at most MAX_LAYERS)."""
    from transformers import AutoConfig

    path = Path(directory) / "config.json"
    try:
        raw = load_json(path.read_bytes(), what=str(path), max_bytes=MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: cannot tell which model to build") from None
    except (OSError, UntrustedInputError) as exc:
        raise ValueError(f"cannot read {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    names = raw.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}: 'architectures' must be a list naming a transformers model class, got "
                         f"{str(names)[:200]}")
    most = MAX_LAYERS if n_tensors is None else min(n_tensors, MAX_LAYERS)
    for key in _LAYER_KEYS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most):
            of = f"a checkpoint of {n_tensors} tensors" if n_tensors is not None else "a model"
            raise ValueError(f"{path}: {key}={str(value)[:50]} is impossible for {of} (at most {most} layers)")
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001  (transformers raises many kinds for a config it cannot use)
        raise ValueError(f"{path} is no config transformers can use: {_first_line(exc)}") from None
    model_class(config)
    return config


def model_class(config: Any) -> type:
    """The transformers model class that ``config.architectures[0]`` names; ValueError for anything else."""
    import transformers

    names = getattr(config, "architectures", None) or []
    name = names[0] if isinstance(names, (list, tuple)) and names else None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
            and getattr(cls, "config_class", None) is not None
            and cls.__name__ == name):
        raise ValueError(f"config.json names no transformers model class in 'architectures' ({str(names)[:200]})")
    return cls


def meta_model(config: Any, where: str | os.PathLike) -> torch.nn.Module:
    """The model `config` describes, built on the meta device (its parameters have shapes, no memory)."""
    try:
        with torch.device("meta"):
            return model_class(config)._from_config(config)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001  (an inconsistent config fails inside the model's constructor)
        raise ValueError(f"{where}: config.json does not describe a model transformers can build: "
                         f"{_first_line(exc)}") from None


def check_shapes(where: str | os.PathLike, found: Mapping[str, Sequence[int]],
                 expected: Mapping[str, Sequence[int]]) -> None:
    """ValueError unless the tensors `found` in checkpoint `where` have exactly the names and shapes `expected`."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: the weights do not match config.json's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    wrong = [(name, list(found[name]), list(expected[name])) for name in sorted(found)
             if tuple(found[name]) != tuple(expected[name])]
    if wrong:
        name, got, want = wrong[0]
        raise ValueError(f"{where}: the weights do not match config.json's model: {name} is {got} in the checkpoint, "
                         f"{want} in the model ({len(wrong)} tensor(s) differ)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
