"""The dialogue environment (kind `dialogue`, the default): `DialogueEnv`, stepped by the sync and the async rollout
loop alike.

An environment is one row of a generation batch (`llm_agent.envs.Environment`): `reset(profile)` starts the
dialogue with a simulated user, `step(turn)` takes the agent's sampled turn (token ids, their log-probs and the
policy version) and `answer(result)` the simulator's answer to the request a step asked for. The environment does
no I/O: it never calls the policy or the simulator, it says what it needs (`Step.request`), so the loops own all
scheduling. The sync loop steps every active dialogue
per turn and sends their requests as one `SimulatorClient.complete` call (re-requests of malformed replies
together); the async loop steps each dialogue at its own pace and awaits `acomplete` per request. Both apply the
rules below, so tokens, loss masks, outcomes and records are the same in both modes.

Per agent turn: the sampled ids go into the dialogue's row of the shared `TokenBuffer` exactly as sampled (loss
1, the turn's index as their `agent_turn_ids`, the engine's log-probs beside them when it returned them; a turn
stopped by the per-turn limit gets an unsampled eos, loss 0 and log-prob 0), are decoded only to be parsed, and then
- cut by the per-dialogue budget: the dialogue ends `truncated`;
- without a well-formed reply tag: a format-error note is the user turn (no simulator call);
- the status `ended` (the agent ends the call): `agent_ended`;
- otherwise the user answers: from the user-response cache (training; the cached words only, the dialogue keeps
  its own user state), or from the simulator (`Step.request`; a malformed reply is re-requested with a new seed,
  away from the instance that sent it (`TurnRequest.avoid`), up to `user_sim.reply_retries` times, then `error`;
  a failed turn is `error`).
The user turn is appended as the chat template's role markers around the spoken reply (loss 0) unless it ends the
dialogue: the status `completed` `completed`, `ended` `hung_up`, an unconfirmed claim of success `agent_ended`, the
last of `max_turns` turns `timeout`, no room left in the budget `truncated` (the status values are the
scenario's). Each outcome has one handler below.

Where later per-turn or per-token data goes: a turn's own fields go into its record (`Dialogue.add_agent_turn` /
`add_user_turn`, one `TurnRecord` per agent turn); per-token data of the agent's sampled tokens
comes back from `TurnBatch.run` beside the ids (as the engine's rollout log-probs do: `SampledTurn`), enters
`step` with them and is stored by `TokenBuffer.append_sampled` in a (B, R) tensor beside the loss mask (0 under
user turns), which `TokenBuffer.final_tensors` returns with the others.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_agent.cache import CachedReply
from llm_agent.envs.base import EnvContext, Environment, Step, TokenBuffer
from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.rollout.outcome import Outcome
from llm_agent.scenario import AgentTurn, StateSchema, UserProfile
from llm_agent.user_sim.client import TurnFailure, TurnReply, TurnRequest, TurnResult
from verl.utils.text_tokens import encode_text
from verl.workers.rollout.engine import SampledTurn

__all__ = ["Dialogue", "DialogueEnv", "RequestSeeds", "stable_seed"]


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from the parts' text, identical across processes (unlike `hash`)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class Dialogue:
    """One row's dialogue: identity, profile, turn records, agent-side messages and the simulator's messages.

    `sim_messages` is exactly `Scenario.render_user_messages(profile, turns)` for the turns so far, grown by one
    or two messages per turn instead of being re-rendered. `user_state` is the user's current state: the
    profile's initial state, then each dimension as the simulator last reported it (a cached turn keeps it).
    `sim_retries` counts the extra simulator requests made for malformed replies, `sim_requests` every request
    sent (cached turns send none); `ended_at` is the `time.monotonic()` reading when the outcome was set.
    """

    row: int
    uid: str
    dialogue_id: str
    profile: UserProfile
    schema: StateSchema
    sim_messages: list[dict[str, str]]
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    outcome: str | None = None
    error: str | None = None
    cache_hits: int = 0
    format_errors: int = 0
    sim_retries: int = 0
    sim_requests: int = 0
    user_state: dict[str, int | None] = field(default_factory=dict)
    ended_at: float | None = None

    def __post_init__(self) -> None:
        if not self.user_state:
            self.user_state = dict(self.profile.state)

    @property
    def active(self) -> bool:
        """True while no outcome is set."""
        return self.outcome is None

    @property
    def num_turns(self) -> int:
        """Agent turns generated so far."""
        return len(self.turns)

    def end(self, outcome: Outcome, error: str | None = None) -> None:
        """Set the outcome (once; the record keeps its string) and, for `error`, the reason."""
        if self.outcome is not None:
            raise RuntimeError(f"dialogue {self.dialogue_id} already ended as {self.outcome}")
        self.outcome, self.error = Outcome(outcome).value, error
        self.ended_at = time.monotonic()

    def add_agent_turn(self, text: str, turn: AgentTurn, spoken: str | None,
                       policy_version: int | None = None) -> TurnRecord:
        """Record an agent turn (decoded text and parse; the policy version that sampled it); `spoken` is what the
        simulator hears of it, None when the simulator does not hear it (a format error or an agent that ended the
        call)."""
        record = TurnRecord(agent_text=text, agent_reply=turn.reply, agent_stage=turn.stage, agent_status=turn.status,
                            agent_state=dict(turn.state), agent_format_ok=not turn.parse_error,
                            policy_version=policy_version)
        self.turns.append(record)
        self.messages.append({"role": "assistant", "content": text})
        if spoken is not None:
            self.sim_messages.append({"role": "user", "content": spoken})
        return record

    def add_user_turn(self, reply: str, state: dict[str, int | None] | None, status: int | None, source: str,
                      shown: str, sim_content: str | None) -> None:
        """Fill the last turn's user side; `shown` is the text the agent sees (possibly truncated) and
        `sim_content` the simulator's canonical own message (None when the simulator was not involved)."""
        record = self.turns[-1]
        record.user_reply, record.user_status, record.user_source = reply, status, source
        record.user_state = None if state is None else {d: state.get(d) for d in self.schema.names}
        if state is not None:
            self.user_state.update({d: v for d, v in state.items() if d in self.schema.names and v is not None})
        self.messages.append({"role": "user", "content": shown})
        if sim_content is not None:
            self.sim_messages.append({"role": "assistant", "content": sim_content})

    def record(self) -> DialogueRecord:
        """The row's dialogue record (uid as given)."""
        return DialogueRecord(dialogue_id=self.dialogue_id, outcome=self.outcome, turns=self.turns, uid=self.uid,
                              profile=self.profile.to_dict(), state_key=self.schema.key(self.profile.state),
                              messages=self.messages, cache_hits=self.cache_hits, format_errors=self.format_errors,
                              sim_retries=self.sim_retries, error=self.error, sim_requests=self.sim_requests)


@dataclass(frozen=True)
class RequestSeeds:
    """The simulator's sampling seed of each request of one rollout call.

    Validation: from the user's profile, the row's place in its group and the turn only, so the fixed validation
    set meets the same simulated users at every validation step; training: from the call number and the dialogue
    id, so each step's users differ. A re-request of a malformed reply (`attempt` > 0) gets its own seed. Seeds
    never depend on the order of requests, so both loop modes send the same ones.
    """

    seed: int
    call: int
    validation: bool

    def __call__(self, dialogue: Dialogue, turn_index: int, attempt: int) -> int:
        """The seed of `dialogue`'s request for agent turn `turn_index`, `attempt`-th request for it."""
        retry = (f"retry{attempt}",) if attempt else ()
        if self.validation:
            group_index = dialogue.dialogue_id.rsplit("#", 1)[1]
            profile = json.dumps(dialogue.profile.to_dict(), sort_keys=True)
            return stable_seed(self.seed, "val", profile, group_index, turn_index, *retry)
        return stable_seed(self.seed, self.call, dialogue.dialogue_id, turn_index, *retry)


@dataclass
class _Pending:
    """The agent turn waiting for the simulator, the number of the request sent for it (0 = first) and the
    instances whose replies to it were malformed."""

    agent: AgentTurn
    attempt: int
    avoid: tuple[str, ...] = ()


class DialogueEnv(Environment):
    """One dialogue between the policy and a simulated user on row `row` of `buffer`; see the module docstring."""

    def __init__(self, context: EnvContext, buffer: TokenBuffer, row: int, uid: str, dialogue_id: str) -> None:
        super().__init__(context, buffer, row, uid, dialogue_id)
        self.dialogue: Dialogue | None = None
        self._pending: _Pending | None = None

    # --------------------------------------------------------------------------------------------- interface
    def reset(self, profile: UserProfile) -> None:
        """Start the dialogue with the user `profile`: the agent's opening context is the row's prompt in the
        buffer; the simulator's context is the persona rendered from the profile."""
        scenario = self.context.scenario
        persona = {"role": "system", "content": scenario.render_user_prompt(profile)}
        self.dialogue = Dialogue(row=self.row, uid=self.uid, dialogue_id=self.dialogue_id, profile=profile,
                                 schema=scenario.state_schema, sim_messages=[persona])
        self._pending = None

    @property
    def ended_at(self) -> float | None:
        """When the dialogue got its outcome (`time.monotonic()`)."""
        return None if self.dialogue is None else self.dialogue.ended_at

    @property
    def active(self) -> bool:
        """True from `reset` until the dialogue has an outcome."""
        return self.dialogue is not None and self.dialogue.active

    def record(self) -> DialogueRecord:
        """The dialogue's record."""
        return self._dialogue(ended=True).record()

    def step(self, turn: SampledTurn) -> Step:
        """Take the agent's next turn: its sampled token ids (eos included when sampled), the engine's log-prob of
        each when it computed them, and the policy version that sampled them."""
        d = self._dialogue()
        if self._pending is not None:
            raise RuntimeError(f"dialogue {self.dialogue_id} waits for the simulator's answer, not an agent turn")
        if d.num_turns >= self.context.max_turns:
            raise RuntimeError(f"dialogue {self.dialogue_id} has no outcome after {d.num_turns} turns")
        kept, cut = self._keep_agent_tokens(turn, d.num_turns)
        text = self.context.tokenizer.decode(kept.tolist(), skip_special_tokens=True)
        scenario, version = self.context.scenario, turn.policy_version
        parsed = scenario.parse_agent_output(text)
        statuses = scenario.statuses
        if cut:
            d.add_agent_turn(text, parsed, None, version)
            return self._truncate()
        if parsed.parse_error:
            d.add_agent_turn(text, parsed, None, version)
            return self._format_error(parsed)
        if parsed.status == statuses.ended:
            d.add_agent_turn(text, parsed, None, version)
            return self._agent_ends()
        # a claim of success (status completed) is heard too: only the user's confirmation completes the call
        d.add_agent_turn(text, parsed, scenario.spoken_agent_reply(parsed), version)
        cache = self.context.cache
        hit = None
        if cache is not None and parsed.status != statuses.completed:
            hit = cache.lookup(d.dialogue_id, parsed.stage, d.user_state)
        if hit is not None:
            return self._cached_turn(hit)
        self._pending = _Pending(parsed, 0)
        return Step(d.turns[-1], request=self._request(0))

    def answer(self, result: TurnResult) -> Step:
        """Take the simulator's answer to the request the last step made."""
        d, pending = self._dialogue(), self._pending
        if pending is None:
            raise RuntimeError(f"dialogue {self.dialogue_id} has no simulator request to answer")
        if result.dialogue_id != d.dialogue_id:
            raise RuntimeError(f"the simulator client answered {result.dialogue_id!r} for {d.dialogue_id!r}")
        if isinstance(result, TurnFailure):
            self._pending = None
            d.turns[-1].user_error = result.reason
            return self._fail(f"user simulator turn failed: {result.reason}")
        if not isinstance(result, TurnReply):
            raise TypeError(f"the simulator client returned a {type(result).__name__} for {d.dialogue_id!r}")
        scenario = self.context.scenario
        user = scenario.parse_user_output(result.text)
        if user.parse_error:
            problems = [f for f in user.flags if f.startswith("out_of_range:")] or \
                [f"no <{scenario.user_tags.tag('reply')}> text"]
            malformed = f"simulator reply malformed ({', '.join(problems)}): {result.text[:200]!r}"
            if pending.attempt < self.context.user_sim.reply_retries:
                d.sim_retries += 1
                pending.attempt += 1
                pending.avoid += (result.instance,)
                return Step(d.turns[-1], request=self._request(pending.attempt, pending.avoid))
            self._pending = None
            d.turns[-1].user_error = malformed
            return self._fail(f"{malformed} (after {pending.attempt + 1} requests)")
        self._pending = None
        cache = self.context.cache
        if cache is not None and pending.agent.status != scenario.statuses.completed:
            cache.add(pending.agent.stage, user.reply, user.state, user.status)
        content = scenario.format_user_output(user.reply, user.state, user.status)
        return self._user_turn(user.reply, user.state, user.status, "simulator", content)

    # ------------------------------------------------------------------------------------------ the rules
    def _dialogue(self, ended: bool = False) -> Dialogue:
        if self.dialogue is None:
            raise RuntimeError(f"dialogue {self.dialogue_id}: reset() first")
        if ended:
            if self.dialogue.active:
                raise RuntimeError(f"dialogue {self.dialogue_id} has no outcome yet")
            return self.dialogue
        if not self.dialogue.active:
            raise RuntimeError(f"dialogue {self.dialogue_id} already ended as {self.dialogue.outcome}")
        return self.dialogue

    def _keep_agent_tokens(self, sampled: SampledTurn, turn: int) -> tuple[torch.Tensor, bool]:
        """Append agent turn `turn`'s sampled ids (loss 1, with their log-probs and policy version) within the
        budget, closing a turn stopped by the per-turn limit with an unsampled eos (loss 0); returns (kept ids, cut
        by the budget)."""
        buffer, eos = self.buffer, self.context.eos_id
        budget = buffer.remaining(self.row)
        ids, log_probs = sampled.ids, sampled.log_probs
        cut = ids.numel() > budget
        ids = ids[:budget]
        buffer.append_sampled(self.row, ids, turn, None if log_probs is None else log_probs[:budget],
                              sampled.policy_version)
        ended = ids.numel() > 0 and ids[-1].item() == eos
        if not cut and not ended:
            if buffer.remaining(self.row) < 1:
                cut = True
            else:
                buffer.append_context(self.row, [eos])
        return ids, cut

    def _request(self, attempt: int, avoid: tuple[str, ...] = ()) -> TurnRequest:
        """The simulator request for the last agent turn (its `attempt`-th request, away from `avoid`)."""
        d, sim = self.dialogue, self.context.user_sim
        d.sim_requests += 1
        return TurnRequest(d.dialogue_id, d.sim_messages, temperature=sim.temperature, top_p=sim.top_p,
                           max_tokens=sim.max_tokens, seed=self.context.seeds(d, d.num_turns - 1, attempt), avoid=avoid)

    def _format_error(self, turn: AgentTurn) -> Step:
        """The agent's output broke the tag protocol: a note naming the problem is its user turn."""
        self.dialogue.format_errors += 1
        if self.context.cache is not None:  # this note is the dialogue's user turn: the next one may be cached
            self.context.cache.end_dialogue(self.dialogue_id)
        out_of_range = any(f.startswith("out_of_range:") for f in turn.flags) and turn.reply
        note = self.context.range_error_message if out_of_range else self.context.format_error_message
        return self._user_turn(note, None, None, "format_error", None)

    def _cached_turn(self, hit: CachedReply) -> Step:
        """Answer with a cached reply's words; the user's state stays the dialogue's own (the cached reply's state
        tags belong to another user), and the simulator sees this turn with that state."""
        d = self.dialogue
        d.cache_hits += 1
        state = dict(d.user_state)
        content = self.context.scenario.format_user_output(hit.reply, state, hit.status)
        return self._user_turn(hit.reply, state, hit.status, "cache", content)

    def _user_turn(self, reply: str, state: dict[str, int | None] | None, status: int | None, source: str,
                   sim_content: str | None) -> Step:
        """Record the user side of the last turn, decide whether the dialogue goes on, and append its tokens."""
        d, context = self.dialogue, self.context
        ids = encode_text(context.tokenizer, reply)  # the one rule for outside text: control-token text stays text
        shown = reply
        if len(ids) > context.max_user_tokens:
            ids = ids[:context.max_user_tokens]
            shown = context.tokenizer.decode(ids)
        statuses = context.scenario.statuses
        claimed = source != "format_error" and d.turns[-1].agent_status == statuses.completed
        d.add_user_turn(reply, state, status, source, shown, sim_content)
        if status == statuses.completed:
            return self._complete()
        if status == statuses.ended:
            return self._hang_up()
        if claimed:  # the agent said the task was done, the user had not agreed: a false claim ends the call
            return self._agent_ends()
        if d.num_turns >= context.max_turns:
            return self._time_out()
        block = context.markers.user_block(ids)
        if len(block) >= self.buffer.remaining(self.row):
            return self._truncate()
        self.buffer.append_context(self.row, block)
        return Step(d.turns[-1], user_ids=block)

    # ------------------------------------------------------------------------- the six outcomes, one handler each
    def _end(self, outcome: Outcome, error: str | None = None) -> Step:
        self.dialogue.end(outcome, error)
        return Step(self.dialogue.turns[-1], outcome=outcome)

    def _complete(self) -> Step:
        """The user completed the task (status completed)."""
        return self._end(Outcome.COMPLETED)

    def _hang_up(self) -> Step:
        """The user ended the call (status ended)."""
        return self._end(Outcome.HUNG_UP)

    def _agent_ends(self) -> Step:
        """The agent gave up, or its claim of success was not confirmed by the user."""
        return self._end(Outcome.AGENT_ENDED)

    def _time_out(self) -> Step:
        """`max_turns` agent turns passed without an end."""
        return self._end(Outcome.TIMEOUT)

    def _truncate(self) -> Step:
        """The per-dialogue token budget ran out (the agent's turn was cut, or the user's would not fit)."""
        return self._end(Outcome.TRUNCATED)

    def _fail(self, reason: str) -> Step:
        """The simulator could not give this turn: the row carries no loss (the loop gives it its own group)."""
        self.buffer.drop_loss(self.row)
        return self._end(Outcome.ERROR, reason)
