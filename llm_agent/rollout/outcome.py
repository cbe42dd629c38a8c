"""How a dialogue ends: the six outcomes (docs/rollout_loop.md, "Outcomes")."""
from __future__ import annotations

import enum

__all__ = ["Outcome"]


class Outcome(enum.StrEnum):
    """The outcome of one dialogue; records hold its value (the plain string)."""

    COMPLETED = "completed"  # the user's status is 1 (also in answer to the agent's claim of success)
    HUNG_UP = "hung_up"  # the user's status is -1
    AGENT_ENDED = "agent_ended"  # the agent gave up (status -1), or claimed success and the user did not confirm
    TIMEOUT = "timeout"  # max_turns agent turns without an end
    TRUNCATED = "truncated"  # the per-dialogue token budget ran out
    ERROR = "error"  # the simulator failed the turn, or its reply stayed malformed: no loss, its own GRPO group
