"""The settings of one scripts/main.sh run, resolved in one place (verl/trainer/presets.py) and handed to the script.

    python -m verl.trainer.launch_settings PRESET [LAUNCHER_KEY=VALUE ...] -- [KEY=VALUE ...]

PRESET is a YAML group of verl/trainer/config/preset/; the keys before `--` are the launcher's (origin
`scripts/main.sh`: the model, the scenario, where the run's files go), those after it the command line's (they
win). Prints bash assignments for `eval`: the values the script itself needs (EXPERIMENT, MODEL_PATH, STEPS,
DEVICE, N_GPUS, MAX_TURNS, SEED, TRAIN_SAMPLES, TEST_SAMPLES, POLICY_GPUS and the run's paths), TRAIN_ARGS (the
trainer's key=value arguments, each key once) and SETTINGS_TEXT (every value a preset, the script or the command
line set, with where it came from: the dry run prints it). An environment variable of the old shell presets
(MAX_TURNS, SEAD_GPU_MAX_TURNS, ...) is refused with the key that replaces it.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from verl.trainer.config_schema import ConfigError
from verl.trainer.presets import Setting, resolve

logger = logging.getLogger(__name__)

# The environment variables of scripts/presets.sh (removed) -> the key that is now the one name of the setting.
REMOVED_VARIABLES = {
    "EXPERIMENT": "trainer.experiment_name", "SEED": "launch.seed", "DEVICE": "trainer.device",
    "N_GPUS": "trainer.n_gpus_per_node", "STEPS": "trainer.total_training_steps",
    "TRAIN_PROMPTS": "data.train_batch_size", "ROLLOUT_N": "actor_rollout_ref.rollout.n",
    "MINI_BATCH": "actor_rollout_ref.actor.ppo_mini_batch_size", "TRAIN_SAMPLES": "launch.train_samples",
    "TEST_SAMPLES": "launch.test_samples", "MAX_TURNS": "rollout_loop.config.max_turns",
    "SEAD_GPU_MAX_TURNS": "rollout_loop.config.max_turns",
    "MAX_TOKENS_PER_TURN": "rollout_loop.config.max_tokens_per_turn",
    "MAX_USER_TOKENS": "rollout_loop.config.max_user_tokens", "RESPONSE_LENGTH": "data.max_response_length",
    "LR": "actor_rollout_ref.actor.optim.lr", "LR_WARMUP_RATIO": "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    "USE_KL_LOSS": "actor_rollout_ref.actor.use_kl_loss", "KL_LOSS_TYPE": "actor_rollout_ref.actor.kl_loss_type",
    "KL_COEF": "actor_rollout_ref.actor.kl_loss_coef", "ENTROPY_COEFF": "actor_rollout_ref.actor.entropy_coeff",
    "TEMPERATURE": "actor_rollout_ref.rollout.temperature",
    "GRAD_CKPT": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "MICRO_BATCH": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "LOGPROB_MICRO_BATCH": "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu and "
                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "USE_DYNAMIC_BSZ": "actor_rollout_ref.actor.use_dynamic_bsz",
    "MAX_TOKEN_LEN": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "LOGPROB_MAX_TOKEN_LEN": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu and "
                             "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "TEST_FREQ": "trainer.test_freq", "SAVE_FREQ": "trainer.save_freq", "MAX_CKPT": "trainer.max_ckpt_to_keep",
    "SAVE_HF_MODEL": "trainer.save_hf_model", "POLICY_GPUS": "launch.policy_gpus",
    "ROLLOUT_ENGINE": "actor_rollout_ref.rollout.name",
    "ROLLOUT_TP": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "ROLLOUT_GPU_MEM": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "LORA_RANK": "actor_rollout_ref.model.lora_rank",
    "LORA_ALPHA": "actor_rollout_ref.model.lora_alpha",
    "ROLLOUT_CORRECTION": "the algorithm.rollout_correction.* keys", "PRESET_OVERRIDES": "the keys themselves",
    "DATA_DIR": "data.train_files and data.val_files", "CKPT_DIR": "trainer.default_local_dir",
    "LOG_DIR": "trainer.log_dir", "ROLLOUT_LOG": "rollout_loop.config.rollout_log_path",
    "VAL_METRICS": "rollout_loop.config.val_metrics_path",
}
# Shell variable -> the key whose resolved value it gets (None when the key is not set: an empty variable).
SCRIPT_VALUES = {
    "EXPERIMENT": "trainer.experiment_name", "MODEL_PATH": "actor_rollout_ref.model.path",
    "STEPS": "trainer.total_training_steps", "DEVICE": "trainer.device", "N_GPUS": "trainer.n_gpus_per_node",
    "MAX_TURNS": "rollout_loop.config.max_turns", "SEED": "launch.seed", "TRAIN_SAMPLES": "launch.train_samples",
    "TEST_SAMPLES": "launch.test_samples", "POLICY_GPUS": "launch.policy_gpus",
    "TRAIN_FILE": "data.train_files", "CKPT_DIR": "trainer.default_local_dir", "LOG_DIR": "trainer.log_dir",
    "ROLLOUT_LOG": "rollout_loop.config.rollout_log_path", "VAL_METRICS": "rollout_loop.config.val_metrics_path",
}


def check_environment(environ: Mapping[str, str]) -> None:
    """ConfigError naming the key of every removed preset variable that is set (non-empty) in `environ`."""
    found = [f"{name} (now {key}=...)" for name, key in REMOVED_VARIABLES.items() if environ.get(name)]
    if found:
        raise ConfigError(f"scripts/main.sh reads settings as key=value arguments only; unset {', '.join(found)} "
                          f"and pass the key instead")


def _shown(text: str) -> str:
    """A value as a shell would need it written."""
    return text if text and all(c.isalnum() or c in "_./:=,@+-[]" for c in text) else shlex.quote(text)


def settings_text(settings: Mapping[str, Setting], preset: str) -> str:
    """Every value set by the preset, the script or the command line, one `key=value  (origin)` line each."""
    lines = [f"settings (preset {preset} over sead_trainer.yaml, whose defaults hold for every other key; "
             f"key=value arguments win; launch.* are scripts/main.sh's):"]
    for key, s in settings.items():
        note = s.origin
        if s.replaced is not None and s.replaced.value != s.value:
            note += f", replacing {s.replaced.value} of {s.replaced.origin}"
        lines.append(f"  {_shown(f'{key}={s.value}')}    ({note})")
    return "\n".join(lines)


def shell_assignments(settings: Mapping[str, Setting], preset: str) -> str:
    """Bash assignments of the script's values, TRAIN_ARGS and SETTINGS_TEXT."""
    out = []
    for name, key in SCRIPT_VALUES.items():
        value = settings[key].value if key in settings else ""
        out.append(f"{name}={shlex.quote('' if value == 'null' else value)}")
    train_file = settings["data.train_files"].value if "data.train_files" in settings else ""
    out.append(f"DATA_DIR={shlex.quote(str(Path(train_file).parent) if train_file else '')}")
    args = [f"{key}={s.value}" for key, s in settings.items() if not key.startswith("launch.")]
    out.append("TRAIN_ARGS=(" + " ".join(shlex.quote(a) for a in args) + ")")
    out.append(f"SETTINGS_TEXT={shlex.quote(settings_text(settings, preset))}")
    return "\n".join(out)


def describe(argv: Sequence[str]) -> str:
    """The trainer's dry run (`python -m verl.trainer.main_ppo [preset=NAME] key=value ... --dry-run`): every value
    the preset or the command line set, with where it came from, checked as the trainer checks its arguments."""
    from verl.trainer.cli_overrides import check_overrides, expand_preset

    checked = check_overrides(argv)
    scenario = [a for a in checked if a.startswith("rollout_loop.config.scenario=")]  # format_prompt=, resolved
    _, preset, settings = expand_preset([*argv, *scenario])
    if settings is None:
        settings = resolve(None, [("command line", [a for a in checked if "=" in a and not a.startswith("-")])])
    return settings_text(settings, preset or "none")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (scripts/main.sh's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0].startswith("-"):
            raise ConfigError("usage: python -m verl.trainer.launch_settings PRESET [KEY=VALUE ...] -- [KEY=VALUE ...]")
        check_environment(os.environ)
        preset, rest = argv[0], argv[1:]
        split = rest.index("--") if "--" in rest else len(rest)
        settings = resolve(preset, [("scripts/main.sh", rest[:split]), ("command line", rest[split + 1:])])
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    print(shell_assignments(settings, preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
