"""The CPU learning recipe: the small model, its warm start and the GRPO settings with which a 2-core CPU box
shows the agent learning. One definition for `make demo` (the CPU preset, verl/trainer/config/preset/cpu.yaml,
reads `preset`, and scripts/main.sh builds the demo's model with `warm-model`), the CI learning test (which runs
the demo) and bench/learning.py (the same recipe, more steps). Measured per seed and float path in BENCHMARKS.md
("Learning").

    python -m utils.cpu_recipe preset        # KEY VALUE lines: the CPU preset's learning settings
    python -m utils.cpu_recipe warm-model --out DIR --scenario F --system-prompt P [--seed 0] [--max-turns 10] \\
        [--steps N]                          # DIR/tiny_model and DIR/tiny_model_warm; prints the model to train

The warm start is what makes an 8-step run learn: a model fine-tuned on scripted calls of a MIXTURE of agent
qualities, mostly "evasive" (follows the SOP but answers only the first 4 of the 14 doubt categories, so most of
its calls end in a hang-up) and a minority of "good" (answers every doubt). Greedy, the warm policy talks past the
doubts it does not know (a low completion rate); it has learnt their answers from the good calls, and its samples
sometimes give one: the good mode GRPO with the completion-only reward then makes the greedy one. GRPO takes many
small steps rather than a few large ones (lr 2e-4, two passes over each step's dialogues): AdamW's first updates
move every weight by about the learning rate whatever its gradient, so a large rate lets float noise, and with it
the CPU's kernels, decide where the first steps go (BENCHMARKS.md, "Learning"). The policy's log-prob and update
forwards run on packed rows (`use_remove_padding`, as on the GPU preset): the update a third to a half shorter
here, the same learning up to rounding. The warm model is rebuilt only when what makes it changes (the recipe,
the seed, the scenario's content, the system prompt, the turn limit): its key holds no path, so a moved or copied
checkout keeps it.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from utils.make_tiny_model import TinyModelSpec

logger = logging.getLogger(__name__)

WARM_KEY_FILE = "warm_start_key.txt"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CpuRecipe:
    """Every setting of the CPU learning recipe (the field names are bench/learning.py's)."""

    # the model: 0.54 M parameters, the scenario's tags as whole tokens (a tagged turn is ~45 tokens)
    hidden_size: int = 128
    intermediate_size: int = 256
    layers: int = 2
    heads: int = 4
    vocab_size: int = 2048
    # the warm start: supervised fine-tuning on scripted calls of the quality mix
    sft_dialogues: int = 1024
    sft_mix: dict[str, float] = field(default_factory=lambda: {"evasive": 0.65, "good": 0.35})
    sft_steps: int = 600
    sft_lr: float = 3e-3
    sft_lr_schedule: str = "constant"  # or cosine (to 0 at the last step)
    sft_batch_size: int = 8
    sft_micro_batch_size: int = 1  # one transcript per forward: no padding, the causal attention's fast path
    sft_ranks: int = 2  # FSDP2 processes of the warm start (torchrun, gloo; its float bits depend on it)
    # GRPO with the completion-only reward
    steps: int = 8
    prompts_per_step: int = 8
    group_size: int = 8
    ppo_mini_prompts: int = 4  # prompts per policy update: two updates per pass
    lr: float = 2e-4
    ppo_epochs: int = 2  # passes over a step's dialogues: four smaller policy updates per step
    temperature: float = 0.7
    max_turns: int = 10
    max_tokens_per_turn: int = 64
    max_user_tokens: int = 48
    max_response_length: int = 768
    train_samples: int = 64
    test_samples: int = 64
    cache_min_bucket_size: int = 2  # the cache serves once a stage holds 2 replies (a few steps never fill 10)
    use_remove_padding: bool = True  # the policy's forwards on packed rows, as on the GPU preset (faster here)
    workers: int = 2  # FSDP ranks (CPU processes)

    @property
    def micro_batch_per_rank(self) -> int:
        """Rows per micro-batch on one rank: a policy update's whole share (the model is small)."""
        return self.ppo_mini_prompts * self.group_size // self.workers

    @property
    def model_spec(self) -> TinyModelSpec:
        """The small model's shape."""
        return TinyModelSpec(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                             intermediate_size=self.intermediate_size, num_hidden_layers=self.layers,
                             num_attention_heads=self.heads, num_key_value_heads=1, tag_tokens=True)

    @property
    def sft_max_length(self) -> int:
        """Tokens kept per warm-start transcript: a dialogue's budget plus the compact prompt."""
        return self.max_response_length + 128

    def preset_values(self) -> dict[str, str]:
        """The CPU preset's keys this recipe sets (verl/trainer/config/preset/cpu.yaml names it), as the command
        line writes them: trainer keys, and scripts/main.sh's launch.* prompt-data sizes."""
        micro = str(self.micro_batch_per_rank)
        return {"trainer.total_training_steps": str(self.steps), "data.train_batch_size": str(self.prompts_per_step),
                "actor_rollout_ref.rollout.n": str(self.group_size),
                "actor_rollout_ref.actor.ppo_mini_batch_size": str(self.ppo_mini_prompts),
                "launch.train_samples": str(self.train_samples), "launch.test_samples": str(self.test_samples),
                "rollout_loop.config.max_turns": str(self.max_turns),
                "rollout_loop.config.max_tokens_per_turn": str(self.max_tokens_per_turn),
                "rollout_loop.config.max_user_tokens": str(self.max_user_tokens),
                "data.max_response_length": str(self.max_response_length),
                "trainer.n_gpus_per_node": str(self.workers),
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": micro,
                "actor_rollout_ref.actor.optim.lr": repr(self.lr),
                "actor_rollout_ref.actor.ppo_epochs": str(self.ppo_epochs),
                "actor_rollout_ref.rollout.temperature": repr(self.temperature),
                "rollout_loop.config.cache.min_bucket_size": str(self.cache_min_bucket_size),
                "actor_rollout_ref.model.use_remove_padding": str(self.use_remove_padding).lower()}


RECIPE = CpuRecipe()


def warm_start_key(recipe: CpuRecipe, scenario: str | Path, seed: int, system_prompt: str, steps: int) -> str:
    """What the warm model is made from, as a hash: the recipe's model and warm-start settings, the seed, the
    scenario file's content, the system prompt and the step count (no path)."""
    what = {"model": asdict(recipe.model_spec), "dialogues": recipe.sft_dialogues, "mix": recipe.sft_mix,
            "steps": steps, "lr": recipe.sft_lr, "schedule": recipe.sft_lr_schedule,
            "batch_size": recipe.sft_batch_size, "micro_batch_size": recipe.sft_micro_batch_size,
            "ranks": recipe.sft_ranks,
            "max_turns": recipe.max_turns, "max_length": recipe.sft_max_length, "seed": seed,
            "system_prompt": system_prompt,
            "scenario_sha256": hashlib.sha256(Path(scenario).read_bytes()).hexdigest()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def warm_start_command(recipe: CpuRecipe, base: Path, out: Path, transcripts: Path, seed: int, steps: int,
                       keep_gathered_weights: bool = True) -> list[str]:
    """The torchrun command of the warm start's SFT (run it in REPO with `warm_start_env()`). Keeping each
    layer's gathered weights from its forward to its backward gives the same weights with fewer all-gathers (the
    model is small), so the warm-start key leaves it out."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={recipe.sft_ranks}",
            "-m", "utils.sft_warm_start", "--model", str(base), "--out", str(out), "--dialogues", str(transcripts),
            "--steps", str(steps), "--lr", repr(recipe.sft_lr), "--lr-schedule", recipe.sft_lr_schedule,
            "--batch-size", str(recipe.sft_batch_size), "--micro-batch-size", str(recipe.sft_micro_batch_size),
            "--seed", str(seed), "--max-length", str(recipe.sft_max_length),
            *(["--keep-gathered-weights"] if keep_gathered_weights else [])]


def warm_start_env() -> dict[str, str]:
    """The warm start's environment: one thread per rank, the repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def build_warm_model(out: str | Path, scenario: str | Path, system_prompt: str, seed: int = 0,
                     recipe: CpuRecipe = RECIPE, steps: int | None = None) -> Path:
    """The recipe's model under `out`: `tiny_model` (random weights, the scenario's tags as tokens) and, unless
    `steps` (default the recipe's) is 0, `tiny_model_warm` fine-tuned on scripted calls. Each is reused when it
    was made from the same inputs. Returns the model to train."""
    from utils.make_tiny_model import build_tiny_model
    from utils.sft_warm_start import scripted_dialogues

    out = Path(out)
    steps = recipe.sft_steps if steps is None else steps
    base = build_tiny_model(out / "tiny_model", seed=seed, spec=recipe.model_spec, scenarios=[scenario])
    if steps == 0:
        return base
    warm = out / "tiny_model_warm"
    key = warm_start_key(recipe, scenario, seed, system_prompt, steps)
    stamp = warm / WARM_KEY_FILE
    base_stamp = (base / "tiny_model_fingerprint.txt").read_text()
    if stamp.exists() and stamp.read_text() == f"{key}\n{base_stamp}":
        return warm
    logger.info("warm start: %d SFT steps on %d scripted calls (%s) over %d ranks", steps, recipe.sft_dialogues,
                ", ".join(f"{q} {w:g}" for q, w in recipe.sft_mix.items()), recipe.sft_ranks)
    dialogues = scripted_dialogues(scenario, recipe.sft_dialogues, recipe.sft_mix, seed=seed,
                                   max_turns=recipe.max_turns, system_prompt=system_prompt)
    with tempfile.TemporaryDirectory(prefix="warm_start_") as tmp:
        transcripts = Path(tmp) / "transcripts.jsonl"
        transcripts.write_text("".join(json.dumps(d) + "\n" for d in dialogues), encoding="utf-8")
        command = warm_start_command(recipe, base, warm, transcripts, seed, steps)
        done = subprocess.run(command, cwd=REPO, env=warm_start_env(), stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"the warm start's SFT failed (exit {done.returncode}): {' '.join(command[:8])} ...")
    stamp.write_text(f"{key}\n{base_stamp}")
    return warm


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("preset", help="print the CPU preset's learning settings (KEY VALUE lines)")
    build = commands.add_parser("warm-model", help="build the demo's model and its warm start (reused if unchanged)")
    build.add_argument("--out", required=True, help="directory of tiny_model and tiny_model_warm")
    build.add_argument("--scenario", required=True, help="scenario YAML (its scripted calls, its tags)")
    build.add_argument("--system-prompt", required=True, help="the agent system prompt of the transcripts")
    build.add_argument("--seed", type=int, default=0, help="seed of the weights, the calls and the SFT order")
    build.add_argument("--max-turns", type=int, default=RECIPE.max_turns, help="agent turns per scripted call")
    build.add_argument("--steps", type=int, default=RECIPE.sft_steps, help="SFT steps (0: no warm start)")
    args = parser.parse_args(argv)
    if args.command == "preset":
        for name, value in RECIPE.preset_values().items():
            print(name, value)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.steps < 0 or args.max_turns < 1:
        parser.error("--steps must be >= 0 and --max-turns >= 1")
    recipe = dataclasses.replace(RECIPE, max_turns=args.max_turns)
    print(build_warm_model(args.out, args.scenario, args.system_prompt, args.seed, recipe, args.steps))


if __name__ == "__main__":
    main()
