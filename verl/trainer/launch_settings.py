"""The settings of one scripts/main.sh run, resolved in one place (verl/trainer/presets.py) and handed to the script.

    python -m verl.trainer.launch_settings PRESET [LAUNCHER_KEY=VALUE ...] -- [KEY=VALUE ...]

PRESET is a YAML group of verl/trainer/config/preset/; the keys before `--` are the launcher's (origin
`scripts/main.sh`: the model, the scenario, where the run's files go), those after it the command line's (they
win). Refuses what the script cannot run (check_launch), warns when the checkpoints already reach the step
count (nothing_to_train), and prints bash assignments for `eval`: the values the script itself needs
(EXPERIMENT, MODEL_PATH, STEPS, DEVICE, N_GPUS, MAX_TURNS, SEED, TRAIN_SAMPLES, TEST_SAMPLES, POLICY_GPUS and
the run's paths), TRAIN_ARGS (the trainer's key=value arguments, each key once) and SETTINGS_TEXT (every value a
preset, the script or the command line set, with where it came from: main.sh prints it). An environment
variable of the old shell presets (MAX_TURNS, SEAD_GPU_MAX_TURNS, ...) is refused with the key that replaces it.
"""
from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from verl.trainer.config_schema import ConfigError
from verl.trainer.presets import ROLLOUT_GPUS, Setting, resolve


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


# Names common in a user's shell for other reasons: set, they are reported as not read instead of refused.
GENERIC_NAMES = frozenset({"SEED", "DEVICE", "LR", "EXPERIMENT", "TEMPERATURE", "DATA_DIR", "LOG_DIR", "CKPT_DIR"})


def check_environment(environ: Mapping[str, str]) -> str | None:
    """ConfigError naming the key of every removed preset variable set (non-empty) in `environ`; for the generic
    names only (GENERIC_NAMES), a warning that they are not read, or None."""
    found = [name for name in REMOVED_VARIABLES if environ.get(name)]
    named = {name: f"{name} (now {REMOVED_VARIABLES[name]}=...)" for name in found}
    refused = [named[name] for name in found if name not in GENERIC_NAMES]
    if refused:
        raise ConfigError(f"scripts/main.sh reads settings as key=value arguments only; unset {', '.join(refused)} "
                          f"and pass the key instead")
    if found:
        return (f"warning: scripts/main.sh does not read {', '.join(named.values())} from the environment; "
                "pass the key to set it")
    return None


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
    named = [a for a in argv if a.split("=", 1)[0].lstrip("+") != "format_prompt"]
    _, preset, settings = expand_preset([*named, *scenario])
    if settings is None:
        settings = resolve(None, [("command line", [a for a in checked if "=" in a and not a.startswith("-")])])
    return settings_text(settings, preset or "none")


def _scenario_of(key: str, value: str) -> Path:
    if key.lstrip("+") == "format_prompt":
        from verl.trainer.cli_overrides import SCENARIO_DIR

        return SCENARIO_DIR / f"{value}.yaml"
    return Path(value)


def check_launch(settings: Mapping[str, Setting], launcher: Sequence[str], command_line: Sequence[str],
                 environ: Mapping[str, str]) -> None:
    """ConfigError for what scripts/main.sh cannot run: a command-line scenario other than the one the script
    passes (SCENARIO's: the prompt data and the simulators use it), trainer GPUs that are miscounted or overlap
    the simulators' SIM_GPUS."""
    scenario = next((a.split("=", 1)[1] for a in launcher if a.startswith("rollout_loop.config.scenario=")), None)
    for arg in command_line:
        key, value = arg.split("=", 1) if "=" in arg else (arg, "")
        if scenario and key.lstrip("+") in ("rollout_loop.config.scenario", "reward.kwargs.scenario", "format_prompt"):
            if _scenario_of(key, value).resolve() != Path(scenario).resolve():
                raise ConfigError(f"{arg} disagrees with SCENARIO={scenario} (the prompt data and the simulators use "
                                  f"SCENARIO): set the scenario with SCENARIO=... only")
    gpus = settings["launch.policy_gpus"].value if "launch.policy_gpus" in settings else "none"
    if gpus == "none":
        return
    policy = gpus.split(",")
    n_gpus = settings["trainer.n_gpus_per_node"].value if "trainer.n_gpus_per_node" in settings else "1"
    rollout = settings[ROLLOUT_GPUS].value if ROLLOUT_GPUS in settings else "0"
    if not (n_gpus.isdigit() and rollout.isdigit()) or len(policy) != int(n_gpus) + int(rollout):
        needs = f"trainer.n_gpus_per_node={n_gpus}" + (f" + {ROLLOUT_GPUS}={rollout}" if rollout != "0" else "")
        raise ConfigError(f"launch.policy_gpus={gpus} lists {len(policy)} GPUs but {needs}")
    sims = environ.get("SIM_GPUS", "")
    for gpu in filter(None, sims.split(",")):
        if gpu in policy:
            raise ConfigError(f"GPU {gpu} is in both launch.policy_gpus={gpus} and SIM_GPUS={sims}")


def nothing_to_train(settings: Mapping[str, Setting], environ: Mapping[str, str]) -> str | None:
    """The warning when the experiment's checkpoints already reach trainer.total_training_steps (the total, not the
    steps to add: the run would resume there and train nothing); None otherwise, with iterations or without resume."""
    steps = settings.get("trainer.total_training_steps")
    ckpt = settings.get("trainer.default_local_dir")
    resume = settings.get("trainer.resume_mode")
    if (steps is None or ckpt is None or not steps.value.isdigit() or environ.get("ITERATIONS", "1") not in ("", "1")
            or (resume is not None and resume.value == "disable")):
        return None
    done = [int(p.name.removeprefix("global_step_")) for p in Path(ckpt.value).glob("global_step_*")
            if p.name.removeprefix("global_step_").isdigit()]
    total = int(steps.value)
    if not done or max(done) < total:
        return None
    return (f"WARNING: nothing to train: {ckpt.value} already holds step {max(done)} and "
            f"trainer.total_training_steps={total} is the total number of steps, not the steps to add: the run "
            f"would resume there and train nothing. trainer.total_training_steps={max(done) + total} trains {total} "
            f"more; another trainer.experiment_name (or trainer.resume_mode=disable) starts anew")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (scripts/main.sh's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0].startswith("-"):
            raise ConfigError("usage: python -m verl.trainer.launch_settings PRESET [KEY=VALUE ...] -- [KEY=VALUE ...]")
        ignored = check_environment(os.environ)
        if ignored:
            print(ignored, file=sys.stderr)
        preset, rest = argv[0], argv[1:]
        split = rest.index("--") if "--" in rest else len(rest)
        settings = resolve(preset, [("scripts/main.sh", rest[:split]), ("command line", rest[split + 1:])])
        check_launch(settings, rest[:split], rest[split + 1:], os.environ)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    warning = nothing_to_train(settings, os.environ)
    if warning:
        print(warning, file=sys.stderr)
    print(shell_assignments(settings, preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
