"""The rollout-engine contract: what generates the policy's turns, for the trainer and for every rollout loop.

A :class:`RolloutEngine` takes a batch of left-padded contexts and returns one sampled turn per row: the keys of
``generate_sequences`` in docs/architecture.md (``prompts, responses, input_ids, attention_mask, position_ids,
response_mask``; ``rollout_log_probs`` when it computes them) and ``meta_info["policy_version"]``, how many policy
updates the weights that sampled have seen (0 for a model that never trains). Implementations: the actor worker
group as seen from the driver (:class:`verl.workers.rollout.replicas.WorkerGroupEngine`) and its replicas, the
in-worker engines ``HFRollout`` and ``vLLMRollout``, and the evaluation's agents (a local model, an
OpenAI-compatible endpoint, the scripted stand-in). Callers type against this class and call its methods
directly; nothing probes an engine for what it has (anchors: veRL's ``BaseRollout``, AReaL's ``InferenceEngine``).
"""
from __future__ import annotations

import abc

from verl.protocol import DataProto

__all__ = ["POLICY_VERSION", "RolloutEngine", "output_policy_version"]

POLICY_VERSION = "policy_version"  # the meta_info key of a generation's policy version


class RolloutEngine(abc.ABC):
    """Generates a batch of turns; see the module docstring.

    ``world_size``: the rows of a batch must be a multiple of it (a generation that is one collective over that
    many ranks; 1 takes any number of rows). ``policy_version``: the version of the weights the engine generates
    with, which its owner sets when it installs new ones. ``replicas()``: engines that can each generate a batch of
    their own (the vLLM tensor-parallel groups of a worker group; by default the engine itself). ``sleep()`` /
    ``wake_up()``: free the accelerator memory the engine holds between rollouts and take it back, where the
    engine can (by default nothing to do). ``close()``: release what it holds, once, when its user is done.
    """

    world_size: int = 1
    policy_version: int = 0

    @abc.abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One sampled response per row of ``prompts``, with ``meta_info["policy_version"]``."""

    def replicas(self) -> list[RolloutEngine]:
        """The engines that can each generate a batch of their own."""
        return [self]

    def sleep(self) -> None:
        """Free the accelerator memory held between rollouts (nothing to do by default)."""

    def wake_up(self) -> None:
        """Take back what :meth:`sleep` freed (nothing to do by default)."""

    def close(self) -> None:
        """Release what the engine holds (connections, an engine process group); nothing by default."""

    def versioned(self, output: DataProto) -> DataProto:
        """``output`` with ``meta_info["policy_version"]`` set to this engine's ``policy_version``."""
        output.meta_info[POLICY_VERSION] = int(self.policy_version)
        return output


def output_policy_version(output: DataProto, engine: RolloutEngine) -> int:
    """The policy version a generation reports; RuntimeError naming the engine when it reports none."""
    version = output.meta_info.get(POLICY_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise RuntimeError(f"{type(engine).__name__}.generate_sequences returned meta_info[{POLICY_VERSION!r}]="
                           f"{version!r}; a RolloutEngine reports the version of the weights that sampled "
                           "(RolloutEngine.versioned)")
    return version
