"""Which simulated user each row of a generation batch talks to: `UserProfiles`.

Training with the controller: one sampled profile per uid group (the rollout.n dialogues of a prompt share their
user, so GRPO compares agents, not users); a uid group the previous call also ran keeps its profile (the ReMax
baseline rolls the same prompts out twice in one step, greedy then sampled, and both must meet the same user).
Validation, or training without the controller: each row's profile from the dataset's `user_profile` column,
checked against the scenario.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llm_agent.controller import StateController
from llm_agent.rollout.config import ROOT_KEY
from llm_agent.scenario import Scenario, UserProfile
from verl.protocol import DataProto

__all__ = ["UserProfiles"]


def _profile_from_row(value: Any, row: int, uid: str) -> UserProfile:
    """Parse the dataset's `user_profile` cell (JSON string or mapping); ValueError naming the row."""
    where = f"non_tensor_batch['user_profile'][{row}] (uid {uid!r})"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if value is None:
        raise ValueError(f"{where} is missing")
    try:
        return UserProfile.from_dict(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


class UserProfiles:
    """Assigns a user profile to every row of a generation batch; see the module docstring."""

    def __init__(self, scenario: Scenario, controller: StateController | None, is_validation: bool) -> None:
        self.scenario, self.controller, self.is_validation = scenario, controller, is_validation
        self._group_profiles: dict[str, UserProfile] = {}  # uid -> profile, previous call only

    def for_rows(self, gen_batch: DataProto, uids: Sequence[str]) -> list[UserProfile]:
        """One profile per row of `gen_batch` (whose uids are `uids`)."""
        if self.controller is not None:
            return self._sampled(uids)
        column = gen_batch.non_tensor_batch.get("user_profile")
        if column is None:
            mode = "validation" if self.is_validation else f"training with {ROOT_KEY}.controller.enabled=false"
            raise ValueError(f"{mode} needs the dataset column 'user_profile' (a JSON profile per row)")
        profiles = [_profile_from_row(column[i], i, uids[i]) for i in range(len(uids))]
        for i, profile in enumerate(profiles):
            try:
                self.scenario.check_profile(profile)
            except ValueError as exc:
                raise ValueError(f"non_tensor_batch['user_profile'][{i}] (uid {uids[i]!r}): {exc}") from None
        return profiles

    def _sampled(self, uids: Sequence[str]) -> list[UserProfile]:
        starts = [i for i in range(len(uids)) if i == 0 or uids[i] != uids[i - 1]]
        group_uids = [uids[i] for i in starts]
        if len(set(group_uids)) != len(group_uids):
            raise ValueError("rows of one uid must be consecutive (repeat with interleave=True) so that each "
                             "GRPO group shares one sampled profile")
        fresh = iter(self.controller.sample(sum(u not in self._group_profiles for u in group_uids)))
        self._group_profiles = {u: self._group_profiles[u] if u in self._group_profiles else next(fresh)
                                for u in group_uids}
        return [self._group_profiles[u] for u in uids]
