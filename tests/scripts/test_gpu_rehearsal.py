"""The GPU preset rehearsed on CPU: `PRESET=rehearsal bash scripts/main.sh` (verl/trainer/config/preset/rehearsal.yaml).

The rehearsal is the GPU preset with only the device and the sizes changed, so whatever the GPU preset sets
(vLLM rollout with TP 2, gradient checkpointing, padding-free forwards and token-budget micro-batches, KL loss,
the reference's parameters offloaded, the engine's sleep and CUDA-graph keys, the HF export in the last checkpoint
only, ...) runs here too. The dry-run test pins that: the two trainer commands differ only in the device and size keys
listed below (written out here, not read from the preset). The `vllm` test runs the
rehearsal itself, with the simulators the script starts, in two launches: one step and a checkpoint, then a
resume from it for the second step.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.machine_lock import cpu_tp_engine
from verl.trainer.launch_settings import REMOVED_VARIABLES

REPO = Path(__file__).resolve().parents[2]
# What a rehearsal may change: the device and sizes (the keys rehearsal.yaml may set; launch.* are main.sh's) ...
DEVICE_AND_SIZES = [
    "trainer.device", "trainer.n_gpus_per_node", "launch.policy_gpus", "trainer.total_training_steps",
    "data.train_batch_size", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "launch.train_samples", "launch.test_samples", "rollout_loop.config.max_turns",
    "rollout_loop.config.max_tokens_per_turn", "rollout_loop.config.max_user_tokens", "data.max_response_length",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "trainer.test_freq", "trainer.save_freq",
]
# ... and the model, with what follows from it: its prompt length and where the run's files go.
MODEL_AND_PATHS = ["actor_rollout_ref.model.path", "data.max_prompt_length", "data.train_files", "data.val_files",
                   "trainer.experiment_name", "trainer.default_local_dir", "trainer.log_dir",
                   "rollout_loop.config.rollout_log_path", "rollout_loop.config.val_metrics_path"]
PRESET_VARS = ["PRESET", "PRINT_CONFIG_ONLY", "MODEL_PATH", "USER_SIM_MODEL", "USER_SIM_URLS", "OUTPUT_DIR",
               "WARM_START_STEPS", "AGENT_PROMPT_FILE", "PYTORCH_CUDA_ALLOC_CONF", *REMOVED_VARIABLES]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PRESET_VARS}
    env.update(OUTPUT_DIR=str(tmp_path / "outputs"), **extra)
    return env


def _trainer_overrides(tmp_path: Path, **env: str) -> tuple[dict[str, str], str]:
    done = subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), "--dry-run"], cwd=tmp_path,
                          env=_env(tmp_path, PYTHON="python", USER_SIM_URLS="http://127.0.0.1:1", **env),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    words = shlex.split(" ".join(line.strip().removesuffix("\\") for line in lines[lines.index("trainer command:") + 1:]))
    start = words.index("sead_trainer") + 1
    return dict(word.split("=", 1) for word in words[start:]), done.stdout


def _rehearsal_sizes() -> set[str]:
    """The keys rehearsal.yaml sets itself (not inherited from gpu.yaml)."""
    from verl.trainer.presets import preset_settings

    return {key for key, s in preset_settings("rehearsal").items() if s.origin == "preset rehearsal"}


@pytest.mark.processes  # runs main.sh --dry-run twice
def test_the_rehearsal_is_the_gpu_preset_with_only_device_and_sizes_changed(tmp_path):
    assert _rehearsal_sizes() - set(DEVICE_AND_SIZES) == {"trainer.experiment_name"}, \
        "the rehearsal changes a key that is not a size"
    gpu, _ = _trainer_overrides(tmp_path, MODEL_PATH="/models/Qwen2.5-14B-Instruct")
    rehearsal, out = _trainer_overrides(tmp_path, PRESET="rehearsal")
    allowed = set(DEVICE_AND_SIZES) | set(MODEL_AND_PATHS)
    changed = {key for key in gpu.keys() | rehearsal.keys() if gpu.get(key) != rehearsal.get(key)}
    assert changed <= allowed, f"the rehearsal differs from the GPU preset in {sorted(changed - allowed)}"
    # the GPU path's keys are there (they come from the GPU preset, not from this list)
    for key, value in {"actor_rollout_ref.rollout.name": "vllm",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size": "2",
                       "actor_rollout_ref.model.enable_gradient_checkpointing": "true",
                       "actor_rollout_ref.model.use_remove_padding": "true",
                       "actor_rollout_ref.actor.use_dynamic_bsz": "true", "actor_rollout_ref.actor.use_kl_loss": "true",
                       "actor_rollout_ref.ref.fsdp_config.param_offload": "true",
                       "actor_rollout_ref.rollout.free_cache_engine": "true", "trainer.save_hf_model": "last",
                       "actor_rollout_ref.rollout.calculate_log_probs": "true",
                       "algorithm.rollout_correction.rollout_is": "token",
                       "algorithm.rollout_correction.rollout_rs": "turn_mean_k3"}.items():
        assert rehearsal[key] == value, key
    assert rehearsal["trainer.device"] == "cpu" and "PYTORCH_CUDA_ALLOC_CONF" not in out
    assert out.startswith("preset: rehearsal")
    # its own experiment, named as one (it was the model directory's name: tiny_model_warm_outbound_ad_trial)
    assert rehearsal["trainer.experiment_name"] == "rehearsal_tiny_model_warm_outbound_ad_trial"
    assert f"/models/{rehearsal['trainer.experiment_name']}/" in rehearsal["actor_rollout_ref.model.path"]


def _run(tmp_path: Path, log: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    python = Path(sys.executable)
    env = _env(tmp_path, PRESET="rehearsal", PYTHON=str(python), PATH=f"{python.parent}:{os.environ['PATH']}",
               VLLM_CPU_KVCACHE_SPACE="1", **env)
    with open(log, "w") as out:
        return subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), "data.max_prompt_length=96",
                               "trainer.logger=[console,jsonl]", *args], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=900)


@pytest.mark.extended  # 153 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")
def test_gpu_preset_rehearsal_trains_checkpoints_and_resumes(tmp_path, warm_model_path):
    from transformers import AutoModelForCausalLM

    from tests.helpers.repo import COMPACT_SYSTEM_PROMPT

    prompt = tmp_path / "agent_prompt.txt"
    prompt.write_text(COMPACT_SYSTEM_PROMPT)
    env = {"MODEL_PATH": warm_model_path, "AGENT_PROMPT_FILE": str(prompt)}
    walls = []
    # one step and its checkpoint, then a resume from it for the second step (whose TP-2 engine starts only if the
    # first launch's leftover CPU shared-memory segments were removed)
    for steps in (1, 2):
        log = tmp_path / f"run{steps}.log"
        start = time.perf_counter()
        with cpu_tp_engine(2):  # no other test's TP engine on this machine meanwhile
            done = _run(tmp_path, log, f"trainer.total_training_steps={steps}", **env)
        walls.append(time.perf_counter() - start)
        assert done.returncode == 0, log.read_text()[-6000:]
    print(f"rehearsal wall time: {walls[0]:.0f} s + {walls[1]:.0f} s (resumed)")
    experiment = f"rehearsal_{Path(warm_model_path).name}_outbound_ad_trial"
    outputs = tmp_path / "outputs"
    first, second = (tmp_path / "run1.log").read_text(), (tmp_path / "run2.log").read_text()
    assert "preset: rehearsal" in first and "rollout.enforce_eager=false" in first
    metrics = [json.loads(line) for line in (outputs / "logs" / experiment / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [m["step"] for m in metrics if "actor/pg_loss" in m]
    assert steps_logged == [1, 2], steps_logged  # step 2 trained by the resumed launch only
    for m in metrics:
        if "actor/pg_loss" in m:
            assert m["timing_s/weight_sync"] > 0 and m["actor/kl_loss"] > -1e-6
            # rollout correction on (the engine and the actor both fp32 here: float noise, nothing rejected)
            # (k3 >= 0 in exact arithmetic; float noise leaves it within 1e-4 of 0 on either side)
            assert abs(m["rollout/kl_k3"]) < 1e-4 and m["rollout_corr/rollout_rs_masked_fraction"] == 0
    ckpts = outputs / "checkpoints" / experiment
    assert (ckpts / "global_step_1" / "actor" / "model.safetensors").is_file()  # the last step of launch 1
    exported = AutoModelForCausalLM.from_pretrained(ckpts / "global_step_2" / "actor")
    assert sum(p.numel() for p in exported.parameters()) > 0
    dialogues = [json.loads(line) for line in
                 (outputs / "rollouts" / experiment / "rollouts.jsonl").read_text().splitlines()]
    assert sum(t["user_source"] == "simulator" for d in dialogues for t in d["turns"]) > 0, \
        "no turn reached the simulators the script started"
    assert f"resumed from {ckpts / 'global_step_1'} at step 1" in second  # the second launch resumed
