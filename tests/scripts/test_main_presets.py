"""scripts/main.sh and scripts/2ins_main.sh presets, through their dry run (PRINT_CONFIG_ONLY=1 / --dry-run).

The dry run prints every value the preset (verl/trainer/config/preset/), the script or the command line set, with
where it came from, and the trainer command, and exits before building, starting or training anything. The
expected values are written out here from the SEAD paper's settings and the CPU demo's, not read from the preset
files; every printed command must also compose and validate as a trainer config.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llm_agent.rollout.config import GenerationConfig
from verl.trainer.config_schema import compose_config
from verl.trainer.config_validation import build_config

pytestmark = pytest.mark.processes

QWEN25_14B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
              "tie_word_embeddings": False}

REPO_ROOT = Path(__file__).resolve().parents[2]
# The environment main.sh reads (cleared for each run), and the old preset variables it now refuses.
from verl.trainer.launch_settings import REMOVED_VARIABLES  # noqa: E402

PRESET_VARS = ["PRESET", "PRINT_CONFIG_ONLY", "MODEL_PATH", "USER_SIM_MODEL", "USER_SIM_URLS", "SIM_INSTANCES",
               "SIM_TP", "SIM_GPUS", "SIM_BASE_PORT", "SCENARIO", "WARM_START_STEPS", "AGENT_PROMPT_FILE",
               "OUTPUT_DIR", "RUN_DIR", "PYTORCH_CUDA_ALLOC_CONF", *REMOVED_VARIABLES]

# The paper's training settings (GPU preset of scripts/main.sh), as trainer overrides.
GPU = {
    "data.train_batch_size": "60", "actor_rollout_ref.rollout.n": "8", "actor_rollout_ref.actor.optim.lr": "1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "0.1", "actor_rollout_ref.actor.use_kl_loss": "true",
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl", "actor_rollout_ref.actor.kl_loss_coef": "0.001",
    "actor_rollout_ref.actor.entropy_coeff": "0.001", "actor_rollout_ref.rollout.temperature": "1.2",
    "rollout_loop.config.max_turns": "15", "actor_rollout_ref.model.enable_gradient_checkpointing": "true",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "60", "data.max_response_length": "6144",
    "rollout_loop.config.max_tokens_per_turn": "256", "trainer.n_gpus_per_node": "6", "trainer.device": "cuda",
    "trainer.save_hf_model": "last", "actor_rollout_ref.model.use_remove_padding": "true",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "true",
    "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size": "2",
    # token-budget micro-batches and the engine's memory as planned at 14B (README "GPU box")
    "actor_rollout_ref.actor.use_dynamic_bsz": "true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "16384",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "32768",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "32768",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "0.55", "actor_rollout_ref.rollout.enforce_eager": "false",
    "actor_rollout_ref.rollout.free_cache_engine": "true",
    # rollout correction (README "Rollout correction": the recommended setting)
    "actor_rollout_ref.rollout.calculate_log_probs": "true", "algorithm.rollout_correction.rollout_is": "token",
    "algorithm.rollout_correction.rollout_rs": "turn_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold": "0.01",
}
# Today's CPU demo settings (CPU preset).
CPU = {
    "data.train_batch_size": "8", "actor_rollout_ref.rollout.n": "8", "actor_rollout_ref.actor.optim.lr": "0.0002",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
    "actor_rollout_ref.actor.use_kl_loss": "false", "actor_rollout_ref.actor.entropy_coeff": "0.0",
    "actor_rollout_ref.rollout.temperature": "0.7", "rollout_loop.config.max_turns": "10",
    "data.max_response_length": "768", "rollout_loop.config.max_tokens_per_turn": "64",
    "trainer.n_gpus_per_node": "2", "trainer.total_training_steps": "8", "trainer.experiment_name": "cpu_demo_outbound_ad_trial",
    "trainer.test_freq": "8", "actor_rollout_ref.actor.ppo_epochs": "2", "data.max_prompt_length": "96",
    "rollout_loop.config.cache.min_bucket_size": "2",
    "trainer.device": "auto", "actor_rollout_ref.actor.use_dynamic_bsz": "false",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "16",  # a policy update's whole share per rank
}


def dry_run(tmp_path: Path, *args: str, script: str = "main.sh", flag: bool = True, **env: str):
    """Run the script's dry run in a clean environment; return (stdout, settings {key: (value, origin)}, trainer
    overrides {key: value}, the override list in order)."""
    clean = {k: v for k, v in os.environ.items() if k not in PRESET_VARS}
    clean.update(OUTPUT_DIR=str(tmp_path / "outputs"), PYTHON="python", **env)
    argv = ["bash", str(REPO_ROOT / "scripts" / script), *(["--dry-run"] if flag else []), *args]
    done = subprocess.run(argv, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index("trainer command:")
    block = {}
    first = next(i for i, line in enumerate(lines) if line.startswith("settings ("))
    for line in lines[first + 1:]:
        if not line.startswith("  "):
            break
        setting, origin = line.strip().rsplit("    (", 1)
        key, value = shlex.split(setting)[0].split("=", 1)
        block[key] = (value, origin.removesuffix(")"))
    words = shlex.split(" ".join(line.strip().removesuffix("\\") for line in lines[at + 1:]))
    if words[0] == "env":  # the GPU preset runs the trainer with CUDA_VISIBLE_DEVICES=<its GPUs>
        words = words[2:]
    assert words[:5] == ["python", "-m", "verl.trainer.main_ppo", "--config-name", "sead_trainer"], words[:5]
    overrides = words[5:]
    keys = [o.split("=", 1)[0] for o in overrides]
    assert len(keys) == len(set(keys)), "a key is passed twice"
    return done.stdout, block, dict(o.split("=", 1) for o in overrides), overrides


def assert_valid(overrides: list[str], model_dir: Path) -> None:
    """The printed command composes with sead_trainer.yaml and passes the trainer's and the loop's checks."""
    overrides = [o for o in overrides if not o.startswith("actor_rollout_ref.model.path=")]
    config = compose_config([*overrides, f"actor_rollout_ref.model.path={model_dir}"], config_name="sead_trainer")
    build_config(config)
    from omegaconf import OmegaConf

    cwd = os.getcwd()
    os.chdir(REPO_ROOT)  # the scenario path is relative to the repository, where the script runs
    try:
        GenerationConfig.from_dict(OmegaConf.to_container(config.rollout_loop.config, resolve=True))
    finally:
        os.chdir(cwd)


def test_without_model_path_the_cpu_preset_applies_and_nothing_is_built(tmp_path):
    out, block, cmd, overrides = dry_run(tmp_path, USER_SIM_URLS="http://127.0.0.1:5000")
    assert out.startswith("preset: cpu (no MODEL_PATH")
    assert {k: cmd[k] for k in CPU} == CPU
    # the demo's models are the experiment's own (its name includes the scenario)
    assert cmd["actor_rollout_ref.model.path"] == \
        f"{tmp_path / 'outputs'}/models/cpu_demo_outbound_ad_trial/tiny_model_warm"
    recipe = "preset cpu (utils.cpu_recipe)"
    assert block["actor_rollout_ref.actor.optim.lr"] == ("0.0002", recipe)
    assert block["rollout_loop.config.max_turns"] == ("10", recipe)
    assert block["launch.seed"] == ("0", "preset cpu") and block["trainer.seed"] == ("0", "launch.seed (preset cpu)")
    assert not any("rollout_correction" in k for k in cmd)
    assert not (tmp_path / "outputs").exists(), "the dry run built or wrote something"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in out
    assert_valid(overrides, tmp_path)


def test_with_model_path_the_papers_gpu_preset_applies(tmp_path):
    model = tmp_path / "models" / "Qwen2.5-14B-Instruct"
    out, block, cmd, overrides = dry_run(tmp_path, MODEL_PATH=str(model), USER_SIM_URLS="http://127.0.0.1:5000")
    assert out.startswith("preset: gpu (MODEL_PATH is set)")
    assert {k: cmd[k] for k in GPU} == GPU
    assert cmd["actor_rollout_ref.model.path"] == str(model)
    # the experiment (checkpoints, cache, logs) is named after the model and the scenario, never cpu_demo
    assert cmd["trainer.experiment_name"] == "Qwen2.5-14B-Instruct_outbound_ad_trial"
    assert cmd["trainer.default_local_dir"].endswith("checkpoints/Qwen2.5-14B-Instruct_outbound_ad_trial")
    assert "reward.kwargs.weights.format" not in cmd, "the CPU demo's reward shaping leaked into the GPU preset"
    assert not any(k.startswith("actor_rollout_ref.model.lora") for k in cmd)  # every weight trains (no LoRA)
    assert {origin for _, origin in block.values()} <= {"preset gpu", "scripts/main.sh"} | {
        o for _, o in block.values() if o.startswith("preset gpu: ")}
    # the trainer (not the simulators, started before it) gets the expandable-segments CUDA allocator
    assert "trainer environment: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out.splitlines()
    assert_valid(overrides, tmp_path)


def test_gpu_lora_preset_trains_a_rank_32_adapter_on_two_gpus_and_fits_the_plan(tmp_path):
    from verl.trainer.plan_phases import build_phases
    from verl.trainer.plan_setup import Hardware, make_setup
    from verl.utils.memory_model import ModelShape

    model = tmp_path / "Qwen2.5-14B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_14B))
    _, block, cmd, overrides = dry_run(tmp_path, MODEL_PATH=str(model), PRESET="gpu_lora",
                                       USER_SIM_URLS="http://127.0.0.1:5000")
    lora = {"actor_rollout_ref.model.lora_rank": "32", "actor_rollout_ref.model.lora_alpha": "32",
            "actor_rollout_ref.actor.optim.lr": "1e-5", "trainer.n_gpus_per_node": "2",
            "actor_rollout_ref.rollout.gpu_memory_utilization": "0.7"}
    assert {k: cmd[k] for k in lora} == lora
    assert {k: cmd[k] for k in GPU if k not in lora} == {k: v for k, v in GPU.items() if k not in lora}
    assert block["launch.policy_gpus"][0] == "0,1"
    assert block["actor_rollout_ref.model.lora_rank"] == ("32", "preset gpu_lora")
    assert block["actor_rollout_ref.actor.kl_loss_coef"] == ("0.001", "preset gpu")  # inherited
    assert_valid(overrides, model)
    # the planner on the printed command at 14B: the training phases fit 80 GB with its 15% error to spare, the
    # rollout (vLLM's pool is a set fraction) no tighter than the full-model GPU preset's 74.6 GB
    config = build_config(compose_config(overrides, config_name="sead_trainer"))
    setup, hw = make_setup(config, ModelShape.from_model_dir(str(model)), None), Hardware()
    phases = {p.name: p.total for p in build_phases(setup, hw)}
    assert phases.pop("rollout (vLLM)") <= 74.6e9
    assert 1.15 * max(phases.values()) <= hw.memory_bytes


def test_dry_run_prints_each_value_with_where_it_came_from_and_what_it_replaced(tmp_path):
    # a value's origins: the preset, the script and a key=value argument (which wins, each key passed once)
    out, block, cmd, _ = dry_run(tmp_path, "rollout_loop.config.max_turns=9", "trainer.val_before_train=false",
                                 "trainer.logger=[console]", MODEL_PATH="/m/agent",
                                 USER_SIM_URLS="http://127.0.0.1:5000")
    lines = out.splitlines()
    assert "  rollout_loop.config.max_turns=9    (command line, replacing 15 of preset gpu)" in lines
    assert "  trainer.val_before_train=false    (command line)" in lines
    assert "  trainer.logger=[console]    (command line, replacing [console,jsonl,tensorboard] of preset gpu)" in lines
    assert "  actor_rollout_ref.model.path=/m/agent    (scripts/main.sh)" in lines
    assert block["actor_rollout_ref.rollout.temperature"] == ("1.2", "preset gpu")
    assert (cmd["rollout_loop.config.max_turns"], cmd["trainer.logger"]) == ("9", "[console]")


def test_key_value_arguments_win_and_values_that_follow_them_follow(tmp_path):
    _, block, cmd, overrides = dry_run(tmp_path, "trainer.save_freq=7", "actor_rollout_ref.actor.optim.lr=3e-6",
                                       "trainer.experiment_name=mine", "data.train_batch_size=30",
                                       MODEL_PATH="/m/agent", USER_SIM_URLS="http://127.0.0.1:5000")
    assert cmd["actor_rollout_ref.actor.optim.lr"] == "3e-6" and cmd["trainer.save_freq"] == "7"
    assert cmd["trainer.experiment_name"] == "mine" and cmd["trainer.default_local_dir"].endswith("checkpoints/mine")
    assert cmd["actor_rollout_ref.actor.ppo_mini_batch_size"] == "30" and block["launch.train_samples"][0] == "1500"
    _, _, forced, _ = dry_run(tmp_path, MODEL_PATH="/m/agent", PRESET="cpu", USER_SIM_URLS="http://127.0.0.1:5000")
    assert forced["actor_rollout_ref.actor.optim.lr"] == "0.0002"
    assert forced["actor_rollout_ref.model.path"] == "/m/agent"


def test_the_old_preset_variables_are_refused_with_the_key_that_replaces_them(tmp_path):
    clean = {k: v for k, v in os.environ.items() if k not in PRESET_VARS}
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "main.sh"), "--dry-run"], cwd=tmp_path,
                          env={**clean, "PYTHON": "python", "MAX_TURNS": "12", "ROLLOUT_N": "4"}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "MAX_TURNS (now rollout_loop.config.max_turns=...)" in done.stderr
    assert "ROLLOUT_N (now actor_rollout_ref.rollout.n=...)" in done.stderr
    # a name a shell may hold for another reason is reported as not read; the run goes on with the preset's value
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "main.sh"), "--dry-run"], cwd=tmp_path,
                          env={**clean, "PYTHON": "python", "LR": "1e-5"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "does not read LR (now actor_rollout_ref.actor.optim.lr=...)" in done.stderr
    assert "actor_rollout_ref.actor.optim.lr=0.0002" in done.stdout


def test_two_instance_script_runs_12_turns_on_the_gpu_preset(tmp_path):
    _, block, cmd, overrides = dry_run(tmp_path, script="2ins_main.sh", MODEL_PATH="/m/agent",
                                       USER_SIM_MODEL="/m/user")
    assert cmd["rollout_loop.config.max_turns"] == "12" and cmd["actor_rollout_ref.actor.optim.lr"] == "1e-6"
    assert cmd["trainer.n_gpus_per_node"] == "6"
    assert block["rollout_loop.config.max_turns"] == ("12", "command line, replacing 15 of preset gpu")
    _, _, mine, _ = dry_run(tmp_path, "rollout_loop.config.max_turns=9", script="2ins_main.sh", MODEL_PATH="/m/agent")
    assert mine["rollout_loop.config.max_turns"] == "9"
    _, _, cpu, _ = dry_run(tmp_path, script="2ins_main.sh", flag=False, PRINT_CONFIG_ONLY="1")
    assert cpu["rollout_loop.config.max_turns"] == "10"
    _, _, rehearsal, _ = dry_run(tmp_path, script="2ins_main.sh", MODEL_PATH="/m/agent", PRESET="rehearsal")
    assert rehearsal["rollout_loop.config.max_turns"] == "6"


def test_cpu_demo_generates_with_vllm_only_where_the_python_has_it(tmp_path):
    no_vllm = tmp_path / "no_vllm"  # an empty directory first on the path: whatever python finds decides
    no_vllm.mkdir()
    stub = tmp_path / "with_vllm"
    (stub / "vllm").mkdir(parents=True)
    (stub / "vllm" / "__init__.py").write_text("")
    has = subprocess.run(["python", "-c", "import vllm"], capture_output=True).returncode == 0
    engine = "actor_rollout_ref.rollout.name"
    _, block, cmd, _ = dry_run(tmp_path, USER_SIM_URLS="http://x:1", PYTHONPATH=str(no_vllm))
    assert block[engine] == ("vllm" if has else "hf", "preset cpu") and cmd[engine] == block[engine][0]
    _, block, cmd, _ = dry_run(tmp_path, USER_SIM_URLS="http://x:1", PYTHONPATH=str(stub))
    assert block[engine] == ("vllm", "preset cpu") and cmd[engine] == "vllm"
    _, block, cmd, _ = dry_run(tmp_path, f"{engine}=hf", USER_SIM_URLS="http://x:1", PYTHONPATH=str(stub))
    assert block[engine] == ("hf", "command line, replacing vllm of preset cpu") and cmd[engine] == "hf"


def test_unknown_preset_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in PRESET_VARS}
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "main.sh"), "--dry-run"], cwd=tmp_path,
                          env={**env, "PRESET": "tpu"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown preset 'tpu'; presets: cpu, gpu, gpu_lora, rehearsal" in done.stderr


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_every_preset_value_is_printed_and_passed(tmp_path, preset):
    from verl.trainer.presets import preset_settings

    _, block, cmd, _ = dry_run(tmp_path, MODEL_PATH="/m/agent", PRESET=preset)
    for key in preset_settings(preset):
        assert key in block, key
        assert key.startswith("launch.") or key in cmd, key
    assert not any(k.startswith("launch.") for k in cmd), "a launch.* key reached the trainer"


def _command_line(out: str) -> str:
    lines = out.splitlines()
    return lines[lines.index("trainer command:") + 1]


def test_gpu_placement_the_trainer_sees_only_its_gpus(tmp_path):
    env = {"MODEL_PATH": str(tmp_path / "m"), "USER_SIM_MODEL": "/models/sim"}
    out, block, _, _ = dry_run(tmp_path, **env)
    assert block["launch.policy_gpus"][0] == "0,1,2,3,4,5"
    assert _command_line(out).split()[:2] == ["env", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5"]
    assert "placement: trainer on GPUs 0,1,2,3,4,5; simulators 6,7" in out
    out, block, _, _ = dry_run(tmp_path, "trainer.n_gpus_per_node=4", "launch.policy_gpus=2,3,4,5", SIM_GPUS="0,1",
                               **env)
    assert _command_line(out).split()[1] == "CUDA_VISIBLE_DEVICES=2,3,4,5"
    cpu_out, _, _, _ = dry_run(tmp_path, USER_SIM_URLS="http://127.0.0.1:5000")
    assert not _command_line(cpu_out).strip().startswith("env")
    # a rollout on GPUs of its own (split placement): the trainer's process sees its GPUs and the rollout's
    out, block, _, _ = dry_run(tmp_path, "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=2",
                               **env)
    assert block["launch.policy_gpus"][0] == "0,1,2,3,4,5"
    assert _command_line(out).split()[1] == "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5"


@pytest.mark.parametrize("args, message", [
    (["launch.policy_gpus=0,1,2,3,4,6"], "GPU 6 is in both launch.policy_gpus=0,1,2,3,4,6 and SIM_GPUS=6,7"),
    (["launch.policy_gpus=0,1,2"], "launch.policy_gpus=0,1,2 lists 3 GPUs but trainer.n_gpus_per_node=6"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=2", "launch.policy_gpus=0,1,2,3"],
     "lists 4 GPUs but trainer.n_gpus_per_node=4 + actor_rollout_ref.rollout.n_gpus_per_node=2"),
])
def test_overlapping_or_miscounted_gpus_are_refused(tmp_path, args, message):
    clean = {k: v for k, v in os.environ.items() if k not in PRESET_VARS}
    clean.update(OUTPUT_DIR=str(tmp_path / "o"), PYTHON="python", MODEL_PATH=str(tmp_path / "m"),
                 USER_SIM_MODEL="/models/sim")
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "main.sh"), "--dry-run", *args], cwd=tmp_path,
                          env=clean, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr
