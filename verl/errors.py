"""Exception types shared by the engine's public API."""

from __future__ import annotations

__all__ = ["ContractError"]


class ContractError(ValueError, AssertionError):
    """A caller broke an API contract (wrong batch size, conflicting values, bad shape).

    It is a `ValueError`, the type SEAD raises for bad input, and also an `AssertionError`, the type veRL raises
    for the same violations, so code written against either (`except ValueError`, `pytest.raises(AssertionError)`)
    catches it.
    """
