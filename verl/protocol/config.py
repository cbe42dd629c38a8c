"""`DataProtoConfig`: the process-wide DataProto settings (veRL's names), today the auto-padding switch."""

from __future__ import annotations

import os

from verl.errors import ContractError

__all__ = ["DataProtoConfig"]


class _DataProtoConfigMeta(type):
    """Metaclass giving `DataProtoConfig.auto_padding` a class-level getter (env default) and a checked setter."""

    _auto_padding: bool | None = None

    @property
    def auto_padding(cls) -> bool:
        """True when set so, or (never set) when the environment variable VERL_AUTO_PADDING is "1" or "true"."""
        if cls._auto_padding is not None:
            return cls._auto_padding
        return os.environ.get("VERL_AUTO_PADDING", "").strip().lower() in ("1", "true")

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ContractError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings (veRL's names).

    `DataProtoConfig.auto_padding = True` (or VERL_AUTO_PADDING=1) lets `chunk` split a batch that does not divide
    evenly; a single DataProto opts in with `from_dict(..., auto_padding=True)`, which sets
    `meta_info[auto_padding_key]`. The `DP_COMPUTE_PROTO` dispatch pads to the world size in any case.
    """

    auto_padding_key = "_verl_auto_padding"
