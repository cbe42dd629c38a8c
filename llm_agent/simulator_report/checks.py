"""The quality checks of one simulator reply, shared by the report card and the simulator's fine-tuning filter.

For a reply to a request (see `reference.py` for what the scripted persona does with the same request):

- accepted: the rollout loop takes it without a re-request (`Scenario.parse_user_output` finds a reply and any
  status is -1, 0 or 1; the loop's own rule);
- format_valid: exactly the tag protocol: reply, the three state tags as integers inside their ranges and the
  status, each once and closed, no protocol tag inside the reply (the parser raised no flag at all), and no
  control-token text (`control_text`: a chat-template marker such as `<|im_start|>`, or a special token of the
  tokenizer the checker is given; `verl.utils.text_tokens`), which would try to end the reply's message and
  open another;
- jump_ok: every state dimension is present and moved from the dialogue's state by no more than the scenario
  allows in one turn (`jump_limits`: every event of the effect table pushing that way at once, or `max_jump`);
- direction_ok: no dimension moved against the agent's turn (the direction the scripted rules' events in the
  agent's words push it; a dimension they leave alone may move either way);
- agrees_direction / agrees_state / agrees_status: the same direction of change on all three dimensions / the
  same new state / the same status as the scripted persona;
- voiced: the behaviour categories whose doubt the reply voices (`DoubtMatcher`).

`passes` (format valid, jumps within the limits, direction consistent) is what the fine-tuning keeps.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from llm_agent.scenario import Scenario, UserTurn
from llm_agent.simulator_report.reference import Reference
from verl.utils.text_tokens import has_control_text

__all__ = ["DoubtMatcher", "ReplyCheck", "ReplyChecker", "jump_limits"]

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
MIN_CONTENT_CHARS = 4  # words this long or longer carry a doubt line's content ("cost", "catch", "scam")
DOUBT_COVERAGE = 0.6  # a reply voices a doubt line when it holds this share of the line's content words


def _sign(value: int) -> int:
    return (value > 0) - (value < 0)


def jump_limits(scenario: Scenario, max_jump: int | None = None) -> dict[str, tuple[int, int]]:
    """(largest fall, largest rise) of each dimension in one turn: what the scenario's effect table gives when
    every event pushing that way happens at once; `max_jump` replaces both with one number."""
    if max_jump is not None:
        if max_jump < 0:
            raise ValueError(f"max_jump must be >= 0, got {max_jump}")
        return {d: (max_jump, max_jump) for d in scenario.dims}
    effects = scenario.scripted.effects.values()
    return {d: (-sum(min(0, e.get(d, 0)) for e in effects), sum(max(0, e.get(d, 0)) for e in effects))
            for d in scenario.dims}


def _words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


class DoubtMatcher:
    """Which behaviour categories' doubts a spoken reply voices, by the scenario's own doubt lines: a line is
    voiced when the reply contains at least 60% of the line's content words (words of 4+ characters), so the
    scripted lines match verbatim and close paraphrases match too."""

    def __init__(self, scenario: Scenario) -> None:
        self._lines = [(category, frozenset(w for w in _words(line) if len(w) >= MIN_CONTENT_CHARS))
                       for category, script in scenario.scripted.categories.items() for line in script.doubt]

    def voiced(self, reply: str | None) -> frozenset[str]:
        """The categories with at least one doubt line voiced in `reply`."""
        if not reply:
            return frozenset()
        words = set(_words(reply))
        return frozenset(c for c, content in self._lines
                         if content and len(content & words) >= DOUBT_COVERAGE * len(content))


@dataclass(frozen=True)
class ReplyCheck:
    """The checks of one reply (see the module docstring); `user` is the parsed reply."""

    user: UserTurn
    accepted: bool
    format_valid: bool
    control_text: bool
    jump_ok: bool
    direction_ok: bool
    agrees_direction: bool
    agrees_state: bool
    agrees_status: bool
    voiced: frozenset[str]

    @property
    def passes(self) -> bool:
        """Format valid, every jump within the limits and no move against the agent's turn."""
        return self.format_valid and self.jump_ok and self.direction_ok


class ReplyChecker:
    """Checks replies against a scenario's protocol, its jump limits and a scripted reference."""

    def __init__(self, scenario: Scenario, max_jump: int | None = None, control_texts: Collection[str] = ()) -> None:
        self.scenario = scenario
        self.limits = jump_limits(scenario, max_jump)
        self.matcher = DoubtMatcher(scenario)
        self.control_texts = tuple(control_texts)

    def check(self, text: str, reference: Reference) -> ReplyCheck:
        """Check the reply `text` to the request whose scripted reaction is `reference`."""
        user = self.scenario.parse_user_output(text)
        state, dims = user.state, self.scenario.dims
        complete = all(isinstance(state[d], int) for d in dims)
        delta: Mapping[str, int] = ({d: state[d] - reference.previous[d] for d in dims} if complete else {})
        jump_ok = complete and all(-self.limits[d][0] <= delta[d] <= self.limits[d][1] for d in dims)
        direction_ok = complete and all(_sign(delta[d]) != -reference.polarity[d] or reference.polarity[d] == 0
                                        for d in dims)
        agrees_direction = complete and all(_sign(delta[d]) == reference.direction[d] for d in dims)
        accepted = not user.parse_error
        control = has_control_text(text, self.control_texts)
        return ReplyCheck(
            user=user, accepted=accepted, control_text=control,
            format_valid=accepted and complete and user.status is not None and not user.flags and not control,
            jump_ok=jump_ok, direction_ok=direction_ok, agrees_direction=agrees_direction,
            agrees_state=complete and dict(state) == reference.state,
            agrees_status=accepted and (user.status if user.status is not None else 0) == reference.status,
            voiced=self.matcher.voiced(user.reply))
