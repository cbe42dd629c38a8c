"""Checkpoint save / resume of a training run (:class:`TrainerCheckpoints`, used by the PPO trainer).

``global_step_N`` holds ``actor/`` and ``critic/`` (written by the worker groups: HF export plus optimizer,
scheduler and RNG state per rank), ``rollout/`` (a rollout of its own: its ranks' RNG states),
``trainer_state.json`` (step, dataloader position, KL coefficient, driver RNG, rollout-loop state, and the resolved
``actor_rollout_ref.model.path`` the run started from),
``trainer_config.json`` (the run's resolved config, secrets left out: :mod:`verl.utils.run_config`), plus
``rollout_loop/`` where the rollout-loop plug-in keeps files of its own (its ``save_checkpoint(dir)`` /
``load_checkpoint(dir)`` hooks). It is written into ``global_step_N.partial``, fsynced and committed by a rename
(:mod:`verl.utils.checkpoint`), so a run killed during a save resumes from the previous checkpoint; a checkpoint
whose files differ from its manifest (or from the digest the run recorded for it), that has no manifest (unless
``trainer.trust_checkpoint``), whose trainer state is unreadable, lacks a key, holds an impossible value (a step
that is not its directory's, a negative position, a non-finite KL coefficient, prompt-loader settings other than
this run's) or a corrupt RNG state is named and skipped for the newest valid one (``resume_mode=auto``) or refused
(``resume_path``), before any worker starts (docs/checkpoints.md). The model a checkpoint was trained from is
recorded by path and by content (:func:`verl.utils.content_digest.model_fingerprint`): resuming one whose model
has other weights now (another path, or the same path rebuilt underneath it) is an error unless
``trainer.resume_from_other_model=true``, while the same weights at another path (a moved checkout) resume; one
whose recorded run inputs (:func:`run_inputs`: the tokenizer's
vocabulary and the scenario file's content, as SHA-256) differ from this run's is always an error that names what
changed, since its weights and cache mean other tokens or another task.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from verl.trainer.config_schema import ConfigError, TrainerConfig
from verl.trainer.ppo.plugins import RolloutLoop
from verl.utils.checkpoint import (
    STATE_FILE,
    begin_checkpoint,
    check_rng_state,
    commit_checkpoint,
    find_latest_checkpoint,
    get_rng_state,
    recorded_digest,
    load_trainer_state,
    remove_partial_checkpoints,
    save_trainer_state,
    set_rng_state,
)
from verl.utils.checkpoint_manifest import verify_checkpoint
from verl.utils.content_digest import model_fingerprint
from verl.utils.run_config import save_run_config

logger = logging.getLogger(__name__)

LOOP_DIR = "rollout_loop"  # the rollout-loop plug-in's own files inside global_step_N/
ROLLOUT_DIR = "rollout"  # the RNG states of a rollout on devices of its own (split placement)
LOADER_SETTINGS = ("seed", "batch_size", "num_samples", "shuffle")  # a resumed prompt loader must match these
REQUIRED_STATE = {"global_step": int, "dataloader": dict, "kl_ctrl_value": (int, float), "rng": dict}
DATALOADER_POSITION = ("epoch", "batch_index")  # what the prompt loader resumes from
SCENARIO_KEY = "rollout_loop.config.scenario"  # the dialogue task's scenario file (absent for other tasks)
REPO_ROOT = Path(__file__).resolve().parents[3]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_inputs(tokenizer: Any, scenario: Optional[str]) -> dict[str, str]:
    """What a checkpoint's weights depend on besides the model path, as SHA-256 digests: the tokenizer's
    vocabulary (token -> id, added tokens included) and, for the dialogue task, the content of the scenario file
    (``scenario``: a path, relative to the working directory or the repository root)."""
    out = {"tokenizer": _sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())}
    if scenario:
        for candidate in (Path(scenario), REPO_ROOT / scenario):
            if candidate.is_file():
                out["scenario"] = _sha256(candidate.read_bytes())
                break
    return out


def check_trainer_state(path: Path, state: dict[str, Any], loader: Optional[Mapping[str, int]] = None) -> None:
    """Raise ValueError naming ``path/trainer_state.json`` and the key unless ``state`` can be resumed from:
    every required key with its type, a ``global_step`` equal to the directory's step, a dataloader position
    of non-negative integers (and, given this run's prompt ``loader`` settings, its seed, batch size, data size
    and shuffle equal to them), a finite non-negative KL coefficient and a restorable RNG state."""
    where = Path(path) / STATE_FILE
    for key, kind in REQUIRED_STATE.items():
        if key not in state:
            raise ValueError(f"{where} has no {key!r} (keys present: {sorted(state)})")
        if isinstance(state[key], bool) or not isinstance(state[key], kind):
            raise ValueError(f"{where}: {key!r} has the wrong type ({type(state[key]).__name__})")
    step = state["global_step"]
    named = Path(path).name.removeprefix("global_step_")
    if step < 0 or (named.isdigit() and step != int(named)):
        raise ValueError(f"{where}: 'global_step' is {step}, but the checkpoint directory is {Path(path).name}")
    for key in DATALOADER_POSITION:
        value = state["dataloader"].get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: 'dataloader.{key}' must be an integer >= 0, got {value!r}")
    for key, expected in (loader or {}).items():
        value = state["dataloader"].get(key)
        if key in state["dataloader"] and (isinstance(value, bool) or not isinstance(value, int) or value != expected):
            raise ValueError(f"{where}: 'dataloader.{key}' is {value!r}, this run's prompt loader has {expected!r} "
                             "(the training data or data.* config changed, or the file was edited)")
    if not math.isfinite(state["kl_ctrl_value"]) or state["kl_ctrl_value"] < 0:
        raise ValueError(f"{where}: 'kl_ctrl_value' must be a finite number >= 0, got {state['kl_ctrl_value']!r}")
    try:
        check_rng_state(state["rng"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclass
class CheckpointedParts:
    """What a checkpoint saves and restores besides the trainer's step: the worker groups (critic None without
    GAE; ``rollout_wg`` the rollout's own group with split placement, else None), the prompt loader, the KL
    controller and the rollout loop."""

    actor_rollout_wg: Any
    critic_wg: Any
    train_loader: Any
    kl_ctrl: Any
    rollout_loop: RolloutLoop
    rollout_wg: Any = None


class TrainerCheckpoints:
    """Save and resume of a run's ``global_step_N`` checkpoints under ``trainer.default_local_dir``.

    Built from the trainer's checked config; ``model_path`` is the resolved ``actor_rollout_ref.model.path`` the
    run trains and ``inputs`` its :func:`run_inputs` (both recorded in each checkpoint and compared on resume);
    ``run_config`` the whole resolved config, written into each checkpoint as ``trainer_config.json``.
    """

    def __init__(self, trainer: TrainerConfig, model_path: str, inputs: Mapping[str, str] | None = None,
                 run_config: Mapping[str, Any] | None = None, loader: Mapping[str, int] | None = None) -> None:
        self.config = trainer
        self.model_path = model_path
        self.model_fingerprint = model_fingerprint(model_path)
        self.inputs = dict(inputs or {})
        self.run_config = run_config
        self.loader = {k: v for k, v in (loader or {}).items() if k in LOADER_SETTINGS}
        self.root = Path(trainer.default_local_dir).resolve()  # workers may run in another directory
        self._chosen: Optional[tuple[Optional[Path]]] = None

    def save(self, step: int, total_steps: int, parts: CheckpointedParts) -> Path:
        """Write ``global_step_<step>`` atomically: worker states, then trainer_state.json, then the commit
        rename."""
        partial = begin_checkpoint(self.root, step)
        mode = self.config.save_hf_model
        hf_model = mode == "every" or (mode == "last" and step >= total_steps)
        parts.actor_rollout_wg.save_checkpoint(str(partial / "actor"), global_step=step, save_hf_model=hf_model)
        if parts.critic_wg is not None:
            parts.critic_wg.save_checkpoint(str(partial / "critic"), global_step=step, save_hf_model=hf_model)
        if parts.rollout_wg is not None:
            parts.rollout_wg.save_rollout_state(str(partial / ROLLOUT_DIR))
        loop_state = parts.rollout_loop.state_dict()
        parts.rollout_loop.save_checkpoint(str(partial / LOOP_DIR))
        save_trainer_state(partial, {
            "global_step": step,
            "total_training_steps": total_steps,
            "dataloader": parts.train_loader.state_dict(),
            "kl_ctrl_value": parts.kl_ctrl.value,
            "rng": get_rng_state(),
            "rollout_loop": None if loop_state is None else dict(loop_state),
            "model_path": self.model_path,
            "model_fingerprint": self.model_fingerprint,
            "run_inputs": self.inputs,
        })
        if self.run_config is not None:
            save_run_config(partial, self.run_config)
        final = commit_checkpoint(self.root, step, self.config.max_ckpt_to_keep)
        logger.info("saved checkpoint %s", final)
        return final

    def check(self, path: Path, state: dict[str, Any]) -> None:
        """ValueError unless checkpoint ``path`` (its trainer ``state``) can be resumed by this run: its files,
        verified against its manifest and the manifest digest the run recorded for it
        (:mod:`verl.utils.checkpoint_manifest`), and its state (:func:`check_trainer_state`, with this run's prompt
        loader)."""
        verify_checkpoint(path, self.config.trust_checkpoint, flag="trainer.trust_checkpoint=true",
                          expected_digest=recorded_digest(path))
        check_trainer_state(path, state, self.loader)

    def to_resume(self) -> Optional[Path]:
        """The checkpoint ``trainer.resume_mode`` selects (None: start from scratch), checked by :meth:`check`
        once (later calls return the same); leftovers are cleaned up. ConfigError when none can be resumed."""
        if self._chosen is None:
            self._chosen = (self._choose(),)
        return self._chosen[0]

    def _choose(self) -> Optional[Path]:
        if self.config.resume_mode == "disable":
            return None
        remove_partial_checkpoints(self.root)
        if self.config.resume_mode == "auto":
            try:
                path = find_latest_checkpoint(self.root, check=self.check)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if path is None:
                logger.info("no checkpoint under %s: training from scratch", self.root)
            return path
        path = Path(self.config.resume_from_path).resolve()
        if not (path / STATE_FILE).is_file():
            raise ConfigError(f"trainer.resume_from_path={str(path)!r} is not a complete checkpoint (no {STATE_FILE})")
        try:
            self.check(path, load_trainer_state(path))
        except ValueError as exc:
            raise ConfigError(f"trainer.resume_from_path: {exc}") from None
        return path

    def check_resume_model(self) -> None:
        """Fail before any worker starts when the checkpoint to resume was trained from another model."""
        path = self.to_resume()
        if path is not None:
            state = load_trainer_state(path)
            check_same_model(path, state, self.model_path, self.config.resume_from_other_model,
                             self.model_fingerprint)
            check_same_inputs(path, state, self.inputs)

    def load(self, parts: CheckpointedParts) -> Optional[tuple[Path, int]]:
        """Resume per ``trainer.resume_mode`` (auto | disable | resume_path) into ``parts``; returns the
        checkpoint used and its step (None: nothing to resume)."""
        path = self.to_resume()
        if path is None:
            return None
        state = load_trainer_state(path)
        check_same_model(path, state, self.model_path, self.config.resume_from_other_model, self.model_fingerprint)
        check_same_inputs(path, state, self.inputs)
        parts.actor_rollout_wg.load_checkpoint(str(path / "actor"))
        if parts.critic_wg is not None:
            if not (path / "critic").is_dir():
                raise FileNotFoundError(f"{path} has no critic/ state, but algorithm.adv_estimator=gae needs one")
            parts.critic_wg.load_checkpoint(str(path / "critic"))
        if parts.rollout_wg is not None:
            restore_rollout_rng(path, parts.rollout_wg)
        parts.train_loader.load_state_dict(state["dataloader"])
        parts.kl_ctrl.value = float(state["kl_ctrl_value"])
        set_rng_state(state["rng"])
        if state.get("rollout_loop") is not None:
            parts.rollout_loop.load_state_dict(state["rollout_loop"])
        parts.rollout_loop.load_checkpoint(str(path / LOOP_DIR))
        step = int(state["global_step"])
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", path, step, parts.train_loader.epoch,
                    parts.train_loader.batch_index)
        return path, step


def restore_rollout_rng(path: Path, rollout_wg: Any) -> None:
    """Give a rollout of its own its RNG states from ``path``; with none saved for its ranks (a checkpoint of a
    colocated run, or another count of rollout devices) it keeps fresh streams and says so."""
    saved = sorted((path / ROLLOUT_DIR).glob("rng_rank_*.json"))
    if len(saved) == rollout_wg.world_size:
        rollout_wg.load_rollout_state(str(path / ROLLOUT_DIR))
        return
    logger.warning("%s holds the RNG states of %d rollout ranks, this run's rollout has %d: it samples from fresh "
                   "RNG streams, so its samples differ from an uninterrupted run's", path, len(saved),
                   rollout_wg.world_size)


def nothing_to_train(step: int, total: int) -> str:
    """What a run resumed at ``step`` with ``trainer.total_training_steps=total <= step`` is told."""
    return (f"nothing to train: the checkpoint resumed is at step {step} and trainer.total_training_steps={total} is "
            f"the total number of steps, not the steps to add; set it above {step} to train on (e.g. {step + total} "
            f"for {total} more steps), or trainer.resume_mode=disable to start over")


def check_same_model(path: Path, state: dict[str, Any], model_path: str, allow_other: bool,
                     fingerprint: Optional[str] = None) -> None:
    """Refuse to resume checkpoint ``path`` (its trainer ``state``) when it was trained from another model than
    this run's (``model_path`` and its content ``fingerprint``), unless ``allow_other``. Both recorded fingerprints
    known: the content decides (the same weights at another path resume: a moved checkout; other weights at the
    same path do not: the model was rebuilt underneath the checkpoint); else the path does. A checkpoint that
    records neither resumes with a warning."""
    recorded, recorded_print = state.get("model_path"), state.get("model_fingerprint")
    if recorded is None:
        logger.warning("%s does not record the model it was trained from (an older checkpoint); resuming it for "
                       "actor_rollout_ref.model.path=%s", path, model_path)
        return
    by_content = recorded_print is not None and fingerprint is not None
    if (recorded_print == fingerprint) if by_content else (recorded == model_path):
        if recorded != model_path:
            logger.info("resuming %s, trained from %s: the same weights as actor_rollout_ref.model.path=%s", path,
                        recorded, model_path)
        return
    if recorded == model_path:
        why = (f"checkpoint {path} was trained from actor_rollout_ref.model.path={recorded!r}, whose weights have "
               "changed since (the model was rebuilt or replaced there): its reference policy and the base it "
               "trained on are gone")
    else:
        why = (f"checkpoint {path} was trained from actor_rollout_ref.model.path={recorded!r}, but this run's model "
               f"is {model_path!r}" + (" (other weights)" if by_content else ""))
    if not allow_other:
        raise ConfigError(f"{why}; use another trainer.experiment_name / trainer.default_local_dir for a new run, or "
                          "set trainer.resume_from_other_model=true to resume it anyway")
    logger.warning("%s; resuming it as trainer.resume_from_other_model=true allows", why)


_INPUT_NAMES = {"tokenizer": "tokenizer (its vocabulary)", "scenario": f"scenario ({SCENARIO_KEY}'s content)"}


def check_same_inputs(path: Path, state: dict[str, Any], inputs: Mapping[str, str]) -> None:
    """Refuse to resume checkpoint ``path`` when a run input it recorded (:func:`run_inputs`) differs from this
    run's ``inputs``, naming each one that changed; an input either side does not record is not compared."""
    recorded = state.get("run_inputs") or {}
    changed = [name for name, digest in inputs.items() if name in recorded and recorded[name] != digest]
    if changed:
        what = " and ".join(_INPUT_NAMES.get(name, name) for name in changed)
        raise ConfigError(
            f"checkpoint {path} was trained with a different {what} from this run's: resuming it would train on "
            f"{'tokens it does not know' if 'tokenizer' in changed else 'another task'}; use another "
            f"trainer.experiment_name / trainer.default_local_dir for this run (scripts/main.sh names the experiment "
            f"after the scenario), or trainer.resume_mode=disable to start from scratch")
