"""verl: the RL engine of SEAD (veRL-style single controller, FSDP workers, PPO/GRPO).

`from verl import DataProto` works as in veRL. `import verl` itself stays light: `DataProto` (and with it torch
and tensordict) is imported on first access, through the module-level `__getattr__`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["DataProto", "__version__"]


def __getattr__(name: str) -> Any:
    """Import `DataProto` from `verl.protocol` when first asked for."""
    if name == "DataProto":
        from verl.protocol import DataProto

        return DataProto
    raise AttributeError(f"module 'verl' has no attribute {name!r}")
