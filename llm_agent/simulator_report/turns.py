"""The simulator turns a report card grades, and how they are read back from logged dialogues.

A `SimTurn` is one request (exactly the chat messages the rollout loop's client sends: persona, then the
dialogue so far) and what came back: the text of every request made for it (a malformed reply is re-requested),
their latencies, and a transport failure if the last request got no answer. A `SimDialogue` groups the turns of
one dialogue (the bootstrap resamples dialogues).

`dialogues_from_log` rebuilds the turns of rollout-log or evaluation records: the request of each simulator
turn is re-rendered with `Scenario.render_user_messages` from the dialogue's earlier turns, the way the loop
grows it (agent turns the simulator never heard, format errors and a call the agent ended, are left out; cached
turns stay in the history but are not graded, since their words were not produced for that request). A logged
turn holds only the accepted reply, re-written canonically, so its first-try checks are unknown; the dialogue's
`sim_retries` count its re-requests.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_agent.scenario import STATUS_ENDED, Scenario, Turn, UserProfile

__all__ = ["SimDialogue", "SimTurn", "dialogues_from_log"]


@dataclass(frozen=True)
class SimTurn:
    """One simulator request and its answers (see the module docstring). `replies` is empty when no request got
    an answer; `first_try_known` is False for logged turns (only the accepted reply was kept)."""

    messages: list[dict[str, str]]
    replies: tuple[str, ...] = ()
    latencies_s: tuple[float, ...] = ()
    failure: str | None = None
    first_try_known: bool = True


@dataclass
class SimDialogue:
    """The graded turns of one dialogue; `logged_rerequests` is a logged dialogue's `sim_retries` (None live)."""

    dialogue_id: str
    profile: UserProfile
    turns: list[SimTurn] = field(default_factory=list)
    logged_rerequests: int | None = None


_TURN_FIELDS = {"agent_text": str, "user_reply": str, "user_source": str, "user_state": dict, "user_status": int,
                "agent_status": int}


def _checked_turn(turn: Any, where: str) -> Mapping[str, Any]:
    """`turn` when each field the rebuild reads has its logged type (or is null); ValueError naming it otherwise."""
    if not isinstance(turn, Mapping):
        raise ValueError(f"{where} is a {type(turn).__name__}, not an object")
    for name, kind in _TURN_FIELDS.items():
        value = turn.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(f"{where}: {name!r} must be a {kind.__name__} or null, got {type(value).__name__}")
    state = turn.get("user_state") or {}
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int)) for v in state.values()):
        raise ValueError(f"{where}: 'user_state' must map each dimension to an integer or null")
    return turn


def _heard_turns(scenario: Scenario, record: Mapping[str, Any], where: str
                 ) -> Iterable[tuple[Turn, Turn | None, Mapping[str, Any]]]:
    """(agent turn, user turn or None, the logged turn) for each agent turn the simulator heard."""
    turns = record.get("turns") or []
    if not isinstance(turns, list):
        raise ValueError(f"{where}: 'turns' must be a list, got {type(turns).__name__}")
    for k, raw in enumerate(turns):
        turn = _checked_turn(raw, f"{where} turn {k}")
        source = turn.get("user_source")
        if source == "format_error":
            continue
        agent = scenario.parse_agent_output(turn.get("agent_text") or "")
        if source is None:
            if turn.get("user_error") and turn.get("agent_status") != STATUS_ENDED:
                yield agent, None, turn  # heard, but no acceptable answer came
            return
        state = turn.get("user_state") or {}
        canonical = scenario.format_user_output(turn.get("user_reply") or "", state, turn.get("user_status"))
        yield agent, scenario.parse_user_output(canonical), turn


def dialogues_from_log(records: Sequence[Mapping[str, Any]], scenario: Scenario) -> list[SimDialogue]:
    """The simulator turns of logged dialogue records (rollout log or evaluation lines; see module docstring).
    ValueError names the record whose profile or a field of whose turns cannot be read.

    A request repeats the dialogue so far: each is the previous one plus two messages, so the requests of a
    dialogue share their text (memory linear in the dialogue, however long its replies)."""
    dialogues = []
    for i, record in enumerate(records):
        where = f"dialogue record {i} ({str(record.get('dialogue_id'))[:100]!r})"
        try:
            profile = UserProfile.from_dict(record.get("profile"))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        retries = record.get("sim_retries") or 0
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"{where}: 'sim_retries' must be an integer >= 0, got {str(retries)[:50]}")
        dialogue = SimDialogue(str(record.get("dialogue_id", i)), profile, logged_rerequests=retries)
        history: list[Turn] = []
        messages: list[dict[str, str]] = []
        for agent, user, logged in _heard_turns(scenario, record, where):
            history.append(agent)
            messages = (messages + scenario.render_user_messages(profile, history[-2:])[1:] if messages
                        else scenario.render_user_messages(profile, history))
            if user is None:
                dialogue.turns.append(SimTurn(messages, failure=str(logged.get("user_error")), first_try_known=False))
                break
            if logged.get("user_source") == "simulator":
                canonical = scenario.format_user_output(user.reply or "", user.state, user.status)
                dialogue.turns.append(SimTurn(messages, (canonical,), first_try_known=False))
            history.append(user)
        dialogues.append(dialogue)
    return dialogues
