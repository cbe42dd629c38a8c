"""Per-dialogue state of the rollout loop: the token buffer of all rows, the chat-template role markers, and
each dialogue's plain-Python record.

`TokenBuffer` holds one preallocated (B, P + R) id tensor (the left-padded prompts in the first P columns, each
row's response tokens appended after them) plus, per response token, the loss mask, the agent turn and the rollout
engine's log-prob (B, R each), and per-row lengths, so building the next turn's left-padded generation batch is a
single gather whose Python cost does not grow with the dialogue.
`ChatMarkers` finds, once, the token pieces a chat template puts around a user turn. `Dialogue` is one row's
dialogue in progress (turns, messages, the simulator's message list kept incrementally); its `record()` is the
row's `DialogueRecord`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.rollout.outcome import Outcome
from llm_agent.scenario import AgentTurn, StateSchema, UserProfile
from verl.utils.agent_turns import AGENT_TURN_IDS

logger = logging.getLogger(__name__)

__all__ = ["ChatMarkers", "Dialogue", "TokenBuffer"]

_AGENT_PLACEHOLDER = "\u2063AGENT\u2063"
_USER_PLACEHOLDER = "\u2063USER\u2063"


@dataclass(frozen=True)
class ChatMarkers:
    """Token ids the chat template puts between an agent turn and a user turn, and after the user turn.

    `before_user` follows the agent turn's end-of-turn token (which the agent samples or the loop appends) and
    opens the user turn; `after_user` closes the user turn and opens the next assistant turn.
    """

    before_user: tuple[int, ...]
    after_user: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, eos_token_id: int) -> "ChatMarkers":
        """Render the tokenizer's chat template around two placeholders and split the text at them.

        The piece between the agent placeholder and the user placeholder starts with the end-of-turn token
        (e.g. ChatML's `<|im_end|>`), which is dropped because the agent's turn already ends with it. Raises
        ValueError when the template has no chat template or does not place the messages verbatim.
        """
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; the rollout loop needs one to write user turns")
        messages = [{"role": "user", "content": "opening"}, {"role": "assistant", "content": _AGENT_PLACEHOLDER},
                    {"role": "user", "content": _USER_PLACEHOLDER}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        agent_at, user_at = text.find(_AGENT_PLACEHOLDER), text.find(_USER_PLACEHOLDER)
        if agent_at < 0 or user_at < agent_at:
            raise ValueError("the chat template does not render message contents verbatim; cannot find the "
                             "role markers between turns")
        between = text[agent_at + len(_AGENT_PLACEHOLDER):user_at]
        after = text[user_at + len(_USER_PLACEHOLDER):]
        before_ids = tokenizer.encode(between, add_special_tokens=False)
        if before_ids and before_ids[0] == eos_token_id:
            before_ids = before_ids[1:]
        else:
            logger.warning("the chat template does not end an assistant turn with the eos token %d; the loop "
                           "appends eos after each agent turn anyway", eos_token_id)
        return cls(tuple(before_ids), tuple(tokenizer.encode(after, add_special_tokens=False)))

    def user_block(self, reply_ids: list[int]) -> list[int]:
        """The ids of one user turn (markers + reply) to append after an agent turn that ended with eos."""
        return [*self.before_user, *reply_ids, *self.after_user]


class TokenBuffer:
    """All rows' tokens: prompts (B, P) left-padded + responses (B, R) right-padded, and per response token the
    loss mask, the agent turn (`agent_turn_ids`: -1 off the loss) and the rollout engine's log-prob (0 off the loss).

    Tokens enter in two ways: `append_sampled` for an agent turn's sampled tokens (loss 1, its turn index and, when
    the engine returned them, its log-probs) and `append_context` for tokens the loop writes itself (user turns, an
    unsampled closing eos: loss 0, turn -1, log-prob 0). Either every sampled turn brings log-probs or none does;
    `final_tensors` returns `rollout_log_probs` only in the first case.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                 pad_token_id: int) -> None:
        if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must be equal (B, P) tensors")
        mask = attention_mask.to(torch.long)
        self.prompt_len = mask.sum(dim=1)
        batch, width = input_ids.shape
        cols = torch.arange(width).unsqueeze(0)
        left_padded = mask.bool() == (cols >= width - self.prompt_len.unsqueeze(1))
        bad = (~left_padded.all(dim=1)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"prompt rows {bad[:8]} are not left-padded (padding then tokens); tokenize the "
                             "prompts with padding_side='left'")
        empty = (self.prompt_len == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"prompt rows {empty[:8]} have no tokens")
        self.prompts = input_ids
        self.prompt_mask = mask
        self.P, self.R, self.pad = width, response_length, pad_token_id
        self.ids = torch.full((batch, width + response_length), pad_token_id, dtype=input_ids.dtype)
        self.ids[:, :width] = input_ids
        self.loss_mask = torch.zeros(batch, response_length, dtype=torch.long)
        self.turn_ids = torch.full((batch, response_length), -1, dtype=torch.long)
        self.log_probs = torch.zeros(batch, response_length, dtype=torch.float32)
        self.with_log_probs: bool | None = None  # set by the first sampled turn
        self.resp_len = [0] * batch

    def remaining(self, row: int) -> int:
        """Response tokens row `row` may still append."""
        return self.R - self.resp_len[row]

    def _put(self, row: int, ids: list[int] | torch.Tensor) -> slice | None:
        """Write `ids` after row `row`'s response so far; returns their response columns (None when empty)."""
        n = len(ids)
        if n == 0:
            return None
        start = self.resp_len[row]
        if start + n > self.R:
            raise ValueError(f"row {row}: appending {n} tokens exceeds the response budget {self.R}")
        values = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=self.ids.dtype)
        self.ids[row, self.P + start:self.P + start + n] = values
        self.resp_len[row] = start + n
        return slice(start, start + n)

    def append_sampled(self, row: int, ids: list[int] | torch.Tensor, turn: int,
                       log_probs: torch.Tensor | None = None) -> None:
        """Append agent turn `turn`'s sampled `ids` to row `row` (loss 1), with the engine's log-prob of each
        (`log_probs`, as long as `ids`) when it returned them (caller checked the budget)."""
        if log_probs is not None and len(log_probs) != len(ids):
            raise ValueError(f"row {row}: {len(log_probs)} log-probs for {len(ids)} sampled tokens")
        with_log_probs = log_probs is not None
        if self.with_log_probs is None:
            self.with_log_probs = with_log_probs
        elif self.with_log_probs != with_log_probs:
            raise ValueError("the rollout engine returned rollout_log_probs for some agent turns and not for others")
        cols = self._put(row, ids)
        if cols is None:
            return
        self.loss_mask[row, cols] = 1
        self.turn_ids[row, cols] = turn
        if log_probs is not None:
            self.log_probs[row, cols] = log_probs.to(torch.float32)

    def append_context(self, row: int, ids: list[int] | torch.Tensor) -> None:
        """Append tokens the loop writes itself (a user turn, an unsampled eos) to row `row`: no loss, no agent
        turn, log-prob 0 (caller checked the budget)."""
        self._put(row, ids)

    def context_batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """Left-padded input_ids / attention_mask / position_ids of `rows`' contexts (prompt + responses so far).

        One gather from the flat buffer: column j of the W-wide result reads buffer column
        `P + resp_len - W + j` of its row, valid (not padding) once j reaches `W - context length`.
        """
        index = torch.tensor(rows, dtype=torch.long)
        resp = torch.tensor([self.resp_len[r] for r in rows], dtype=torch.long)
        lengths = self.prompt_len[index] + resp
        width = int(lengths.max())
        cols = torch.arange(width).unsqueeze(0)
        pad_cols = (width - lengths).unsqueeze(1)
        src = (self.P + resp).unsqueeze(1) - width + cols
        flat = index.unsqueeze(1) * self.ids.size(1) + src.clamp(min=0)
        valid = cols >= pad_cols
        ids = torch.where(valid, self.ids.view(-1)[flat], self.pad)
        return {"input_ids": ids, "attention_mask": valid.to(torch.long),
                "position_ids": (cols - pad_cols).clamp(min=0)}

    def drop_loss(self, row: int) -> None:
        """Take every token of row `row` out of the loss (a dialogue that ended in an error): loss 0, no agent
        turn, log-prob 0."""
        self.loss_mask[row] = 0
        self.turn_ids[row] = -1
        self.log_probs[row] = 0.0

    def final_tensors(self) -> dict[str, torch.Tensor]:
        """The generation-batch tensors of all rows: the generate_sequences keys, `agent_turn_ids` and, when the
        engine returned them, `rollout_log_probs`."""
        responses = self.ids[:, self.P:].clone()
        lengths = torch.tensor(self.resp_len, dtype=torch.long)
        response_attention = (torch.arange(self.R).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.long)
        attention = torch.cat([self.prompt_mask, response_attention], dim=1)
        tensors = {"prompts": self.prompts, "responses": responses,
                   "input_ids": torch.cat([self.prompts, responses], 1), "attention_mask": attention,
                   "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
                   "response_mask": self.loss_mask.clone(), AGENT_TURN_IDS: self.turn_ids.clone()}
        if self.with_log_probs:
            tensors["rollout_log_probs"] = self.log_probs.clone()
        return tensors


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
