"""What a training step's rollouts tell the controller and the simulator error-rate guard.

`StepOutcomes` gathers the outcomes of every dialogue a training step sampled (every generation batch, also those
dynamic sampling drops later; not a greedy ReMax baseline) and, at the step's end, gives the controller its
(state key, completed) pairs and stops the run when simulator errors stay above `user_sim.max_error_rate` for
`user_sim.error_patience` steps in a row. Where no rollout counted the step's dialogues (several rollouts in flight:
the end-of-step hook counts the trained batch's, which holds every dialogue the step sampled), `counted` is False.
"""
from __future__ import annotations

from collections.abc import Sequence

from llm_agent.rollout.config import ROOT_KEY
from llm_agent.rollout.dialogue_record import DialogueRecord
from llm_agent.rollout.outcome import Outcome
from llm_agent.user_sim.client import UserSimConfig

__all__ = ["StepOutcomes"]


class StepOutcomes:
    """The sampled outcomes of the current training step and the count of steps in a row above the error rate."""

    def __init__(self, user_sim: UserSimConfig) -> None:
        self.max_error_rate = user_sim.max_error_rate
        self.error_patience = user_sim.error_patience
        self._completions: list[tuple[str, bool]] = []  # (state key, completed) of non-error dialogues
        self._errors: list[str] = []  # error reasons
        self._dialogues = 0
        self.error_steps = 0  # consecutive steps above max_error_rate

    def add(self, records: Sequence[DialogueRecord]) -> None:
        """Count the dialogues of one generation batch of the step."""
        for r in records:
            if r.outcome == Outcome.ERROR:
                self._errors.append(r.error or Outcome.ERROR.value)
            else:
                self._completions.append((r.state_key, r.outcome == Outcome.COMPLETED))
        self._dialogues += len(records)

    @property
    def counted(self) -> bool:
        """Whether dialogues were counted since the step's outcomes were last taken."""
        return self._dialogues > 0

    def take_completions(self) -> list[tuple[str, bool]]:
        """The step's (state key, completed) pairs for the controller, then forgotten."""
        completions, self._completions = self._completions, []
        return completions

    def check_error_rate(self, step: int) -> dict[str, float]:
        """The step's simulator-error rate over every sampled dialogue (then forgotten); raises RuntimeError when
        it has stayed above `max_error_rate` for `error_patience` steps in a row."""
        total, errors = self._dialogues, self._errors
        self._dialogues, self._errors = 0, []
        rate = len(errors) / total if total else 0.0
        self.error_steps = self.error_steps + 1 if rate > self.max_error_rate else 0
        if self.error_steps >= self.error_patience:
            raise RuntimeError(
                f"stopping at step {step}: {rate:.0%} of the step's {total} dialogues ended in a user-simulator "
                f"error, above {ROOT_KEY}.user_sim.max_error_rate={self.max_error_rate} for {self.error_steps} "
                f"steps in a row (error_patience={self.error_patience}); e.g. {errors[0]!r}")
        return {"user_sim/step_error_rate": rate, "user_sim/error_steps_in_a_row": float(self.error_steps)}
