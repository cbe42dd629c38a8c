"""Hand-written dialogue records for the diagnosis tests: one agent turn and the user side that followed it, and a
record of such turns (the rollout loop's per-dialogue format, without the loop's annotations)."""
from __future__ import annotations

from typing import Any

DIMS = ("cooperation", "emotion", "trust")


def turn(reply: str = "Hello, this is Mia from FoodLoop.", stage: int | None = 0, status: int = 0,
         user: str | None = "Okay.", state: tuple | None = (2, 2, 2), source: str | None = "simulator",
         ok: bool = True, user_status: int | None = None) -> dict[str, Any]:
    """One agent turn and the user side after it; `state` None: the user side reported no state, a None entry: that
    dimension was not reported; `user_status` defaults to 0 for a user turn and None otherwise."""
    reported = None if state is None else dict(zip(DIMS, state))
    if user_status is None and source in ("simulator", "cache"):
        user_status = 0
    return {"agent_text": reply, "agent_reply": reply if ok else None, "agent_stage": stage, "agent_status": status,
            "agent_state": None, "agent_format_ok": ok, "user_reply": user, "user_status": user_status,
            "user_state": reported, "user_source": source, "user_error": None}


def record(outcome: str, turns: list[dict[str, Any]], initial: tuple = (2, 2, 2), dialogue_id: str = "d#0",
           **extra: Any) -> dict[str, Any]:
    """A dialogue record with these turns, the initial state `initial` and no behaviours."""
    return {"dialogue_id": dialogue_id, "profile": {**dict(zip(DIMS, initial)), "behaviors": []},
            "outcome": outcome, "num_turns": len(turns), "turns": turns, **extra}
