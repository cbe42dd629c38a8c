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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.scenario import Scenario, Turn, UserProfile

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
    """The graded turns of one dialogue; `logged_rerequests` is a logged dialogue's `sim_retries` (None live);
    `agent` is the quality of the scripted agent that spoke in a probe dialogue (None for a logged one)."""

    dialogue_id: str
    profile: UserProfile
    turns: list[SimTurn] = field(default_factory=list)
    logged_rerequests: int | None = None
    agent: str | None = None


def _heard_turns(scenario: Scenario, record: DialogueRecord) -> Iterable[tuple[Turn, Turn | None, TurnRecord]]:
    """(agent turn, user turn or None, the logged turn) for each agent turn the simulator heard."""
    for turn in record.turns:
        source = turn.user_source
        if source == "format_error":
            continue
        agent = scenario.parse_agent_output(turn.agent_text or "")
        if source is None:
            if turn.user_error and turn.agent_status != scenario.statuses.ended:
                yield agent, None, turn  # heard, but no acceptable answer came
            return
        canonical = scenario.format_user_output(turn.user_reply or "", turn.user_state or {}, turn.user_status)
        yield agent, scenario.parse_user_output(canonical), turn


def dialogues_from_log(records: Sequence[DialogueRecord], scenario: Scenario) -> list[SimDialogue]:
    """The simulator turns of logged dialogue records (rollout log or evaluation lines; see module docstring).
    ValueError names the record whose profile does not fit the scenario (`DialogueRecord.from_dict` checked
    the turns' fields when the log was read).

    A request repeats the dialogue so far: each is the previous one plus two messages, so the requests of a
    dialogue share their text (memory linear in the dialogue, however long its replies)."""
    dialogues = []
    for i, record in enumerate(records):
        where = f"dialogue record {i} ({record.dialogue_id[:100]!r})"
        try:
            profile = UserProfile.from_dict(record.profile)
            scenario.check_profile(profile)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        dialogue = SimDialogue(record.dialogue_id or str(i), profile, logged_rerequests=record.sim_retries)
        history: list[Turn] = []
        messages: list[dict[str, str]] = []
        for agent, user, logged in _heard_turns(scenario, record):
            history.append(agent)
            messages = (messages + scenario.render_user_messages(profile, history[-2:])[1:] if messages
                        else scenario.render_user_messages(profile, history))
            if user is None:
                dialogue.turns.append(SimTurn(messages, failure=str(logged.user_error), first_try_known=False))
                break
            if logged.user_source == "simulator":
                canonical = scenario.format_user_output(user.reply or "", user.state, user.status)
                dialogue.turns.append(SimTurn(messages, (canonical,), first_try_known=False))
            history.append(user)
        dialogues.append(dialogue)
    return dialogues
