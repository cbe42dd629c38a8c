"""The environment contract of the rollout loop and the registry of environment kinds.

An environment is one episode on one row of a generation batch: the loop's schedulers (sync and async) hand it the
policy's sampled turns (`step`) and the simulator's answers to the requests it makes (`answer`), and it decides
what the row's context gets next and when the episode ends; it does no I/O itself. Every kind shares the
constructor `cls(context, buffer, row, uid, dialogue_id)` and `reset(profile)`, and gives its `record()` (a
`DialogueRecord`) when the episode is over.

Every environment of a call writes its row of one `TokenBuffer` (the prompts and all rows' responses so far, with
the loss mask, agent-turn ids and rollout log-probs beside them), from which the loop builds each generation
batch; `ChatMarkers` are the token pieces the chat template puts around a user turn.

Kinds are registered by name (`register_env("dialogue", DialogueEnv)`, or an entry point `"pkg.module:Class"`
imported on first use) and chosen per run by `rollout_loop.config.env` and per row by the dataset column
`env_class` (as SkyRL's `env_class`); a dotted class path also names a kind. Registration refuses a class that is
not an `Environment` or leaves a method of the contract unimplemented, naming it.
"""
from __future__ import annotations

import abc
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llm_agent.rollout.dialogue_record import DialogueRecord, TurnRecord
from llm_agent.rollout.outcome import Outcome
from llm_agent.user_sim.client import TurnRequest, TurnResult
from verl.protocol import DataProto, pad_dataproto_to_divisor
from verl.utils.agent_turns import AGENT_TURN_IDS
from verl.workers.rollout.engine import ROLLOUT_POLICY_VERSIONS, SampledTurn, TurnBatch

if TYPE_CHECKING:
    from llm_agent.cache import UserResponseCache
    from llm_agent.scenario import Scenario, UserProfile
    from llm_agent.user_sim.client import UserSimConfig

logger = logging.getLogger(__name__)

__all__ = ["ENV_COLUMN", "AgentBatches", "ChatMarkers", "EnvContext", "Environment", "Step", "TokenBuffer",
           "env_class", "register_env", "registered_envs"]

ENV_COLUMN = "env_class"  # the dataset column that picks a row's environment kind


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
    loss mask, the agent turn (`agent_turn_ids`: -1 off the loss), the rollout engine's log-prob (0 off the loss) and
    the policy version that sampled it (`rollout_policy_versions`: -1 off the loss).

    Tokens enter in two ways: `append_sampled` for an agent turn's sampled tokens (loss 1, its turn index and, when
    the engine returned them, its log-probs) and `append_context` for tokens the loop writes itself (user turns, an
    unsampled closing eos: loss 0, turn -1, log-prob 0). Either every sampled turn brings log-probs or none does;
    `final_tensors` returns `rollout_log_probs` only in the first case, and `rollout_policy_versions` only when every
    sampled turn brought its policy version (an environment may leave it out).
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
        self.versions = torch.full((batch, response_length), -1, dtype=torch.long)
        self.all_versioned = True  # until a sampled turn comes without its policy version
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
                       log_probs: torch.Tensor | None = None, policy_version: int | None = None) -> None:
        """Append agent turn `turn`'s sampled `ids` to row `row` (loss 1), with the engine's log-prob of each
        (`log_probs`, as long as `ids`) when it returned them and the policy version that sampled them when known
        (caller checked the budget)."""
        if log_probs is not None and len(log_probs) != len(ids):
            raise ValueError(f"row {row}: {len(log_probs)} log-probs for {len(ids)} sampled tokens")
        if policy_version is not None and policy_version < 0:
            raise ValueError(f"row {row}: policy version {policy_version} is negative")
        if self.with_log_probs is None:
            self.with_log_probs = log_probs is not None
        elif self.with_log_probs != (log_probs is not None):
            raise ValueError("the rollout engine returned rollout_log_probs for some agent turns and not for others")
        self.all_versioned = self.all_versioned and policy_version is not None
        cols = self._put(row, ids)
        if cols is None:
            return
        self.loss_mask[row, cols] = 1
        self.turn_ids[row, cols] = turn
        if log_probs is not None:
            self.log_probs[row, cols] = log_probs.to(torch.float32)
        if policy_version is not None:
            self.versions[row, cols] = policy_version

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
        turn, log-prob 0, version -1."""
        self.loss_mask[row] = 0
        self.turn_ids[row] = -1
        self.log_probs[row] = 0.0
        self.versions[row] = -1

    def final_tensors(self) -> dict[str, torch.Tensor]:
        """The generation-batch tensors of all rows: the generate_sequences keys, `agent_turn_ids` and, when the
        engine returned them, `rollout_log_probs` and `rollout_policy_versions`."""
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
        if self.with_log_probs is not None and self.all_versioned:
            tensors[ROLLOUT_POLICY_VERSIONS] = self.versions.clone()
        return tensors


class AgentBatches:
    """Builds the generation batch of some rows of `buffer`: their contexts, the rollout's decoding `meta`
    (from the trainer), the eos/pad ids and a per-call `response_length` of at most `max_tokens_per_turn` (and no
    more than the longest remaining budget among the rows)."""

    def __init__(self, buffer: TokenBuffer, meta: dict[str, Any], eos_id: int, pad_id: int,
                 max_tokens_per_turn: int) -> None:
        self.buffer, self.meta = buffer, meta
        self.eos_id, self.pad_id, self.max_tokens_per_turn = eos_id, pad_id, max_tokens_per_turn

    def __call__(self, rows: list[int], world_size: int) -> TurnBatch:
        """The left-padded batch of `rows`' contexts, padded to a multiple of `world_size` rows."""
        response_length = min(self.max_tokens_per_turn, max(self.buffer.remaining(r) for r in rows))
        batch = DataProto.from_dict(tensors=self.buffer.context_batch(rows), meta_info={
            **self.meta, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id,
            "response_length": response_length})
        padded, pad_size = pad_dataproto_to_divisor(batch, world_size)
        return TurnBatch(padded, pad_size, response_length)


@dataclass(frozen=True)
class EnvContext:
    """What every environment of one rollout call shares: the scenario, the tokenizer and its chat markers, the
    limits, the simulator's sampling settings, the loop's notes for unreadable turns, the cache (None: no cache)
    and the simulator request seeds (`seeds(dialogue, turn, attempt)`)."""

    scenario: Scenario
    tokenizer: Any
    markers: ChatMarkers
    eos_id: int
    max_turns: int
    max_user_tokens: int
    user_sim: UserSimConfig
    format_error_message: str
    range_error_message: str
    cache: UserResponseCache | None
    seeds: Any


@dataclass(frozen=True)
class Step:
    """What one `Environment.step` or `.answer` did.

    `request`: the simulator must answer it (pass its answer to `answer`) before the turn is complete;
    `user_ids`: the user turn appended to the context (role markers included; None when none was); `outcome`: set
    once the episode has ended; `record`: the turn's record.
    """

    record: TurnRecord
    request: TurnRequest | None = None
    user_ids: list[int] | None = None
    outcome: Outcome | None = None


class Environment(abc.ABC):
    """One episode on row `row` of `buffer` (see the module docstring). `ended_at`: the `time.monotonic()` reading
    when the episode got its outcome (the loop's pacing metrics)."""

    ended_at: float | None = None

    def __init__(self, context: EnvContext, buffer: TokenBuffer, row: int, uid: str, dialogue_id: str) -> None:
        self.context, self.buffer, self.row, self.uid, self.dialogue_id = context, buffer, row, uid, dialogue_id

    @abc.abstractmethod
    def reset(self, profile: UserProfile) -> None:
        """Start the episode with the simulated user `profile` (the row's prompt is already in the buffer)."""

    @property
    @abc.abstractmethod
    def active(self) -> bool:
        """True from `reset` until the episode has an outcome."""

    @abc.abstractmethod
    def step(self, turn: SampledTurn) -> Step:
        """Take the policy's next turn (its sampled ids, their log-probs and the policy version)."""

    @abc.abstractmethod
    def answer(self, result: TurnResult) -> Step:
        """Take the simulator's answer to the request the last step made."""

    @abc.abstractmethod
    def record(self) -> DialogueRecord:
        """The finished episode's record."""


_REGISTRY: dict[str, type[Environment] | str] = {}


def _checked(name: str, cls: Any) -> type[Environment]:
    """`cls` when it is a complete Environment subclass; TypeError naming `name` and what is wrong otherwise."""
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise TypeError(f"environment {name!r}: {cls!r} is not a subclass of llm_agent.envs.Environment")
    missing = sorted(cls.__abstractmethods__)
    if missing:
        raise TypeError(f"environment {name!r}: {cls.__name__} does not implement {missing} of the Environment "
                        "contract")
    return cls


def register_env(name: str, entry_point: type[Environment] | str) -> None:
    """Register an environment kind under `name`: a class (checked now) or `"pkg.module:Class"` (checked when first
    used). ValueError when `name` is taken by another kind."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an environment name must be a non-empty string, got {name!r}")
    if not isinstance(entry_point, str):
        _checked(name, entry_point)
    if name in _REGISTRY and _REGISTRY[name] != entry_point:
        raise ValueError(f"environment {name!r} is already registered ({_REGISTRY[name]!r})")
    _REGISTRY[name] = entry_point


def registered_envs() -> list[str]:
    """The registered kinds' names, sorted."""
    return sorted(_REGISTRY)


def _import(path: str, name: str) -> Any:
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not sep or not attr:
        raise KeyError(f"environment {name!r}: {path!r} is neither a registered kind ({registered_envs()}) nor a "
                       "class path (pkg.module.Class)")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"environment {name!r}: cannot import {path!r} ({exc})") from None


def env_class(name: str) -> type[Environment]:
    """The class of the environment kind `name`: a registered name or a class path; KeyError naming the
    registered kinds when neither, TypeError when the class breaks the contract."""
    entry = _REGISTRY.get(name)
    if entry is None:
        if not isinstance(name, str) or "." not in name:
            raise KeyError(f"unknown environment {name!r}; registered: {registered_envs()} (or give a class path)")
        entry = name
    cls = _checked(name, _import(entry, name) if isinstance(entry, str) else entry)
    _REGISTRY.setdefault(name, cls)
    return cls
