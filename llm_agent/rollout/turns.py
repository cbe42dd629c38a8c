"""What happens to one dialogue in one turn, shared by the sync and the async rollout loop.

`DialogueTurnsMixin` is mixed into `llm_agent.generation.LLMGenerationManager`. Its methods act on one dialogue
(or build and run one generation batch), so the turn-synchronous loop and the per-dialogue async loop apply
exactly the same rules: how sampled tokens are kept, how an agent turn is parsed and answered (format-error
note, end of call, cache hit or simulator request), how a simulator answer is applied or re-requested, and how
a user turn is appended and decides the outcome.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from llm_agent.cache import CachedReply
from llm_agent.rollout.dialogue import Dialogue, TokenBuffer
from llm_agent.scenario import AgentTurn, STATUS_COMPLETED, STATUS_ENDED
from llm_agent.user_sim.client import ChatReply, ChatRequest, TurnFailure
from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

__all__ = ["DialogueTurnsMixin", "GenerationCall", "stable_seed"]


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from the parts' text, identical across processes (unlike `hash`)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class GenerationCall:
    """One `generate_sequences` batch for some rows: built from the token buffer, run, checked."""

    def __init__(self, rows: list[int], batch: DataProto, pad_size: int, response_length: int) -> None:
        self.rows, self.batch, self.pad_size, self.response_length = rows, batch, pad_size, response_length

    def run(self, generate: Any) -> tuple[torch.Tensor, list[int]]:
        """Call `generate(batch)` (a worker group's `generate_sequences`); returns (responses, sampled lengths)."""
        out = unpad_dataproto(generate(self.batch), self.pad_size)
        responses = out.batch["responses"]
        if responses.size(0) != len(self.rows) or responses.size(1) > self.response_length:
            raise RuntimeError(f"generate_sequences returned responses of shape {tuple(responses.shape)} for "
                               f"{len(self.rows)} rows and response_length {self.response_length}")
        lengths = out.batch["attention_mask"][:, -responses.size(1):].sum(dim=1).tolist()
        return responses, lengths


class DialogueTurnsMixin:
    """Per-dialogue turn rules of the rollout loop; see the module docstring. Uses the manager's attributes."""

    config: Any
    scenario: Any
    tokenizer: Any
    wg: Any
    cache: Any
    markers: Any
    eos_id: int
    pad_id: int
    is_validation: bool
    format_error_message: str
    range_error_message: str
    _calls: int

    # ----------------------------------------------------------------------------------------- agent side
    def _generation_call(self, rows: list[int], buffer: TokenBuffer, meta: dict[str, Any],
                         world_size: int) -> GenerationCall:
        """The left-padded batch of `rows`' contexts, padded to a multiple of `world_size` rows."""
        response_length = min(self.config.max_tokens_per_turn, max(buffer.remaining(r) for r in rows))
        batch = DataProto.from_dict(tensors=buffer.context_batch(rows), meta_info={
            **meta, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id, "response_length": response_length})
        padded, pad_size = pad_dataproto_to_divisor(batch, world_size)
        return GenerationCall(rows, padded, pad_size, response_length)

    def _keep_agent_tokens(self, d: Dialogue, ids: torch.Tensor, buffer: TokenBuffer) -> tuple[torch.Tensor, bool]:
        """Append the sampled `ids` (loss 1) within the dialogue's budget, closing a turn stopped by the per-turn
        limit with an unsampled eos (loss 0); returns (kept ids, cut by the budget)."""
        budget = buffer.remaining(d.row)
        cut = ids.numel() > budget
        ids = ids[:budget]
        buffer.append(d.row, ids, 1)
        ended = ids.numel() > 0 and ids[-1].item() == self.eos_id
        if not cut and not ended:
            if buffer.remaining(d.row) < 1:
                cut = True
            else:
                buffer.append(d.row, [self.eos_id], 0)
        return ids, cut

    def _agent_output(self, d: Dialogue, text: str, cut: bool, buffer: TokenBuffer) -> AgentTurn | None:
        """Parse and record one agent turn and answer it where no simulator is needed (cut, format error, end of
        call, cache hit); returns the turn when the simulator must answer it."""
        turn = self.scenario.parse_agent_output(text)
        if cut:
            d.add_agent_turn(text, turn, None)
            d.end("truncated")
            return None
        if turn.parse_error:
            d.add_agent_turn(text, turn, None)
            d.format_errors += 1
            if self.cache is not None:  # this note is the dialogue's user turn: the next one may be cached
                self.cache.end_dialogue(d.dialogue_id)
            out_of_range = any(f.startswith("out_of_range:") for f in turn.flags) and turn.reply
            note = self.range_error_message if out_of_range else self.format_error_message
            self._user_turn(d, buffer, note, None, None, "format_error", None)
            return None
        if turn.status == STATUS_ENDED:
            d.add_agent_turn(text, turn, None)
            d.end("agent_ended")
            return None
        # a claim of success (status 1) is heard too: only the user's confirmation completes the call
        d.add_agent_turn(text, turn, self.scenario.spoken_agent_reply(turn))
        hit = None
        if self.cache is not None and turn.status != STATUS_COMPLETED:
            hit = self.cache.lookup(d.dialogue_id, turn.stage, d.user_state)
        if hit is None:
            return turn
        self._cached_turn(d, buffer, hit)
        return None

    def _cached_turn(self, d: Dialogue, buffer: TokenBuffer, hit: CachedReply) -> None:
        """Answer with a cached reply's words; the user's state stays the dialogue's own (the cached reply's state
        tags belong to another user), and the simulator sees this turn with that state."""
        d.cache_hits += 1
        state = dict(d.user_state)
        content = self.scenario.format_user_output(hit.reply, state, hit.status)
        self._user_turn(d, buffer, hit.reply, state, hit.status, "cache", content)

    # ------------------------------------------------------------------------------------- simulator side
    def _request_seed(self, d: Dialogue, turn_index: int, attempt: int = 0) -> int:
        """The simulator's sampling seed for one turn of `d`. Validation: from the user's profile, the row's place
        in its group and the turn only, so the fixed validation set meets the same simulated users at every
        validation step; training: also from the call count and the dialogue id, so each step's users differ.
        A re-request of a malformed reply (`attempt` > 0) gets its own seed."""
        retry = (f"retry{attempt}",) if attempt else ()
        if self.is_validation:
            group_index = d.dialogue_id.rsplit("#", 1)[1]
            profile = json.dumps(d.profile.to_dict(), sort_keys=True)
            return stable_seed(self.config.seed, "val", profile, group_index, turn_index, *retry)
        return stable_seed(self.config.seed, self._calls, d.dialogue_id, turn_index, *retry)

    def _sim_request(self, d: Dialogue, attempt: int) -> ChatRequest:
        """The simulator request for `d`'s last agent turn (its `attempt`-th request for that turn)."""
        sim = self.config.user_sim
        return ChatRequest(d.dialogue_id, d.sim_messages, temperature=sim.temperature, top_p=sim.top_p,
                           max_tokens=sim.max_tokens, seed=self._request_seed(d, d.num_turns - 1, attempt))

    def _take_reply(self, d: Dialogue, agent: AgentTurn, result: Any, attempt: int, buffer: TokenBuffer) -> bool:
        """Apply the answer to `d`'s `attempt`-th request; True when a malformed reply must be re-requested
        (`user_sim.reply_retries` bounds it, after which the dialogue ends as `error`)."""
        malformed = self._apply_reply(d, agent, result, buffer)
        if malformed is None:
            return False
        if attempt < self.config.user_sim.reply_retries:
            d.sim_retries += 1
            return True
        d.turns[-1]["user_error"] = malformed
        d.end("error", f"{malformed} (after {attempt + 1} requests)")
        return False

    def _apply_reply(self, d: Dialogue, agent: AgentTurn, result: Any, buffer: TokenBuffer) -> str | None:
        """Apply one simulator answer to `d`; returns why the reply is malformed (to be re-requested), else None."""
        if result.dialogue_id != d.dialogue_id:
            raise RuntimeError(f"the simulator client answered {result.dialogue_id!r} for {d.dialogue_id!r}")
        if isinstance(result, TurnFailure):
            d.turns[-1]["user_error"] = result.reason
            d.end("error", f"user simulator turn failed: {result.reason}")
            return None
        if not isinstance(result, ChatReply):
            raise TypeError(f"the simulator client returned a {type(result).__name__} for {d.dialogue_id!r}")
        user = self.scenario.parse_user_output(result.text)
        if user.parse_error:
            tag = self.scenario.user_tags.tag("reply")
            problems = [f for f in user.flags if f.startswith("out_of_range:")] or [f"no <{tag}> text"]
            return f"simulator reply malformed ({', '.join(problems)}): {result.text[:200]!r}"
        if self.cache is not None and agent.status != STATUS_COMPLETED:
            self.cache.add(agent.stage, user.reply, user.state, user.status)
        content = self.scenario.format_user_output(user.reply, user.state, user.status)
        self._user_turn(d, buffer, user.reply, user.state, user.status, "simulator", content)
        return None

    def _user_turn(self, d: Dialogue, buffer: TokenBuffer, reply: str, state: dict[str, int | None] | None,
                   status: int | None, source: str, sim_content: str | None) -> None:
        """Record the user side of the last turn, decide whether the dialogue goes on, and append its tokens."""
        ids = self.tokenizer.encode(reply, add_special_tokens=False, split_special_tokens=True)
        shown = reply
        if len(ids) > self.config.max_user_tokens:
            ids = ids[:self.config.max_user_tokens]
            shown = self.tokenizer.decode(ids)
        claimed = source != "format_error" and d.turns[-1]["agent_status"] == STATUS_COMPLETED
        d.add_user_turn(reply, state, status, source, shown, sim_content)
        if status == STATUS_COMPLETED:
            d.end("completed")
        elif status == STATUS_ENDED:
            d.end("hung_up")
        elif claimed:  # the agent said the task was done, the user had not agreed: a false claim ends the call
            d.end("agent_ended")
        elif d.num_turns >= self.config.max_turns:
            d.end("timeout")
        else:
            block = self.markers.user_block(ids)
            if len(block) >= buffer.remaining(d.row):
                d.end("truncated")
            else:
                buffer.append(d.row, block, 0)
