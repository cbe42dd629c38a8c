"""The rollout-engine contract: what generates the policy's turns, for the trainer and for every rollout loop.

A :class:`RolloutEngine` takes a batch of left-padded contexts and returns one sampled turn per row: the keys of
``generate_sequences`` in docs/architecture.md (``prompts, responses, input_ids, attention_mask, position_ids,
response_mask``; ``rollout_log_probs`` when it computes them) and ``meta_info["policy_version"]``, how many policy
updates the weights that sampled have seen (0 for a model that never trains). Implementations: the actor worker
group as seen from the driver (:class:`verl.workers.rollout.replicas.WorkerGroupEngine`) and its replicas, the
in-worker engines ``HFRollout`` and ``vLLMRollout``, and the evaluation's agents (a local model, an
OpenAI-compatible endpoint, the scripted stand-in). Callers type against this class and call its methods
directly; nothing probes an engine for what it has (anchors: veRL's ``BaseRollout``, AReaL's ``InferenceEngine``).
:class:`TurnBatch` runs one batch of turns on an engine and checks what comes back: one :class:`SampledTurn` per
row (its ids, log-probs and policy version).
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl.protocol import DataProto, unpad_dataproto

__all__ = ["POLICY_VERSION", "ROLLOUT_POLICY_VERSIONS", "RolloutEngine", "SampledTurn", "TextStreaming", "TurnBatch", "output_policy_version"]

POLICY_VERSION = "policy_version"  # the meta_info key of a generation's policy version
ROLLOUT_POLICY_VERSIONS = "rollout_policy_versions"  # batch key: (bs, R) version that sampled each token, -1 off it


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


class TextStreaming(abc.ABC):
    """An engine that can hand out the text of a one-row generation as it is written (a page showing an agent's
    turn while it is generated): a local model its decoded tokens, an endpoint the pieces it streams. Callers check
    for it with ``isinstance``."""

    @abc.abstractmethod
    def stream_text(self, listener: Callable[[str | None], None] | None) -> None:
        """Call ``listener`` with each new piece of text of a one-row generation, then None when the generation
        (or an attempt at it that is retried) ends: the pieces since the last None, joined, are the text so far.
        None as ``listener`` stops it."""


@dataclass(frozen=True)
class SampledTurn:
    """One row's turn as the engine sampled it: the token ids (eos included when sampled), the engine's log-prob of
    each (`rollout_log_probs`, aligned with `ids`; None when the engine did not compute them) and the policy
    version that sampled them (None when not known)."""

    ids: torch.Tensor
    log_probs: torch.Tensor | None = None
    policy_version: int | None = None


@dataclass(frozen=True)
class TurnBatch:
    """A batch of turns to generate: left-padded contexts (``batch``, padded to a multiple of the engine's world
    size with ``pad_size`` rows) and the most tokens a turn may take (``response_length``)."""

    batch: DataProto
    pad_size: int
    response_length: int

    def run(self, engine: RolloutEngine) -> list[SampledTurn]:
        """Generate the batch on ``engine``; each row's sampled turn, in row order: its ``responses`` up to its
        sampled length, with its ``rollout_log_probs`` when present and the generation's policy version.
        RuntimeError naming the engine when the output breaks the contract."""
        generated = engine.generate_sequences(self.batch)
        version = output_policy_version(generated, engine)
        out = unpad_dataproto(generated, self.pad_size)
        responses = out.batch["responses"]
        rows = len(self.batch) - self.pad_size
        if responses.size(0) != rows or responses.size(1) > self.response_length:
            raise RuntimeError(f"{type(engine).__name__}.generate_sequences returned responses of shape "
                               f"{tuple(responses.shape)} for {rows} rows and response_length {self.response_length}")
        lengths = out.batch["attention_mask"][:, -responses.size(1):].sum(dim=1).tolist()
        log_probs = out.batch["rollout_log_probs"] if "rollout_log_probs" in out.batch.keys() else None
        if log_probs is not None and log_probs.shape != responses.shape:
            raise RuntimeError(f"{type(engine).__name__}.generate_sequences returned rollout_log_probs of shape "
                               f"{tuple(log_probs.shape)} for responses of shape {tuple(responses.shape)}")
        return [SampledTurn(responses[i, :n], None if log_probs is None else log_probs[i, :n], version)
                for i, n in enumerate(lengths)]


def output_policy_version(output: DataProto, engine: RolloutEngine) -> int:
    """The policy version a generation reports; RuntimeError naming the engine when it reports none."""
    version = output.meta_info.get(POLICY_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise RuntimeError(f"{type(engine).__name__}.generate_sequences returned meta_info[{POLICY_VERSION!r}]="
                           f"{version!r}; a RolloutEngine reports the version of the weights that sampled "
                           "(RolloutEngine.versioned)")
    return version
