"""A user's own scenario through `SCENARIO=... bash scripts/main.sh`, as a new user writes one (issue 30).

Each run stops before anything is trained: at the scenario check (a broken file, a misspelt key, a behaviour
category without a rule: refused in about a second, before the warm start, with nothing written), at a dead
simulator URL, or at the dry run / `--plan` (what the run would do). The scenario files are written here, from the
shipped one with the changes a user makes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llm_agent.scenario import DEFAULT_SCENARIO_PATH
from llm_agent.user_sim.processes import free_port

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
CLEARED = ("PRESET", "PRINT_CONFIG_ONLY", "MODEL_PATH", "USER_SIM_MODEL", "USER_SIM_URLS", "SCENARIO", "EXPERIMENT",
           "AGENT_PROMPT_FILE", "ITERATIONS", "WARM_START_STEPS", "DEVICE")


def new_scenario(tmp_path: Path, name: str = "pizza_trial", **changes) -> Path:
    """The shipped scenario as a new user's copy: another name, platform and compact prompt, its behaviour library
    by absolute path; `changes` are top-level keys to replace (None: delete)."""
    data = yaml.safe_load(DEFAULT_SCENARIO_PATH.read_text(encoding="utf-8"))
    data["name"] = name
    data["vars"]["platform"] = "PizzaNow"
    data["agent"]["compact_prompt"] = "You are ${agent_name} from ${platform}. Get the trial claimed; answer in tags."
    data["behavior_library"] = str((DEFAULT_SCENARIO_PATH.parent / data["behavior_library"]).resolve())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def main_sh(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run scripts/main.sh as a user does (outputs under tmp_path); returns the process and its wall time."""
    clean = {k: v for k, v in os.environ.items() if k not in CLEARED}
    clean.update(OUTPUT_DIR=str(tmp_path / "outputs"), PYTHON=sys.executable, **env)
    start = time.perf_counter()
    done = subprocess.run(["bash", str(REPO / "scripts" / "main.sh"), *args], cwd=tmp_path, env=clean,
                          capture_output=True, text=True, timeout=120)
    return done, time.perf_counter() - start


def trainer_overrides(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    words = [line.strip().removesuffix("\\").strip() for line in lines[lines.index("trainer command:") + 2:]]
    return dict(w.split("=", 1) for w in words)


def test_a_broken_scenario_is_refused_first_and_names_the_file_and_the_key(tmp_path):
    agent = yaml.safe_load(DEFAULT_SCENARIO_PATH.read_text(encoding="utf-8"))["agent"]
    agent["openning"] = agent.pop("opening")  # a misspelt key
    bad = new_scenario(tmp_path, agent=agent)
    done, wall = main_sh(tmp_path, SCENARIO=str(bad))  # a real run, not a dry run
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{bad}: agent.opening: missing required key ('openning' in the file: did you mean 'opening'?)" \
        in done.stderr
    assert "Traceback" not in done.stderr and "warm start" not in done.stdout
    assert not (tmp_path / "outputs").exists(), "something was built before the scenario was checked"
    assert wall < 30, wall

    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("name: x\nstages: [\n", encoding="utf-8")
    done, _ = main_sh(tmp_path, SCENARIO=str(syntax))
    assert done.returncode == 2 and f"{syntax}: line 3" in done.stderr and "YAML syntax error" in done.stderr
    done, _ = main_sh(tmp_path, "--dry-run", SCENARIO="outbound_ad_trail")
    assert done.returncode == 2 and "did you mean" in done.stderr and "outbound_ad_trial.yaml" in done.stderr


def test_a_new_behaviour_category_needs_its_rule_before_anything_runs(tmp_path):
    categories = yaml.safe_load(DEFAULT_SCENARIO_PATH.read_text(encoding="utf-8"))["scripted"]["categories"]
    scripted = yaml.safe_load(DEFAULT_SCENARIO_PATH.read_text(encoding="utf-8"))["scripted"]
    scripted["categories"] = {**categories, "allergy_questions": {"doubt": ["Is the pizza gluten free?"],
                                                                  "resolve": ["gluten"]}}
    behaviors = [{"category": "allergy_questions", "behavior": "Asks about allergens before anything else."},
                 {"category": "testing", "behavior": "Asks the same question twice."}]
    path = new_scenario(tmp_path, scripted=scripted, behavior_library=None, behaviors=behaviors)
    done, _ = main_sh(tmp_path, SCENARIO=str(path))
    assert done.returncode == 2
    assert "no rule for behaviour category ['allergy_questions']" in done.stderr and str(path) in done.stderr
    assert not (tmp_path / "outputs").exists()
    # with its rule in a table of the user's own (controller.rules_path), or without rules, the dry run goes on
    table = yaml.safe_load((REPO / "assets" / "behavior_rules.yaml").read_text(encoding="utf-8"))
    table["categories"]["allergy_questions"] = {"why": "any user may ask", "contradicts": []}
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(table), encoding="utf-8")
    for override in (f"rollout_loop.config.controller.rules_path={rules}",
                     "rollout_loop.config.controller.profile_source=uniform"):
        done, _ = main_sh(tmp_path, "--dry-run", override, SCENARIO=str(path))
        assert done.returncode == 0, done.stderr


def test_a_new_scenario_gets_its_own_experiment_and_prompt_and_a_draft_beside_it_breaks_nothing(tmp_path):
    path = new_scenario(tmp_path)
    (tmp_path / "draft.yaml").write_text("name: [unfinished\n", encoding="utf-8")  # a broken draft beside it
    done, _ = main_sh(tmp_path, "--dry-run", SCENARIO=str(path), USER_SIM_URLS="http://127.0.0.1:9")
    assert done.returncode == 0, done.stderr
    cmd = trainer_overrides(done.stdout)
    assert cmd["rollout_loop.config.scenario"] == str(path)
    assert cmd["trainer.experiment_name"] == "cpu_demo_pizza_trial"
    outputs = tmp_path / "outputs"
    assert cmd["actor_rollout_ref.model.path"] == f"{outputs}/models/cpu_demo_pizza_trial/tiny_model_warm"
    for key, where in (("data.train_files", "prompt_data"), ("trainer.default_local_dir", "checkpoints"),
                       ("trainer.log_dir", "logs"), ("rollout_loop.config.rollout_log_path", "rollouts")):
        assert cmd[key].startswith(f"{outputs}/{where}/cpu_demo_pizza_trial"), (key, cmd[key])
    # what the tiny agent is told comes from the YAML (its agent.compact_prompt, vars filled in)
    assert "agent system prompt: You are Mia from PizzaNow. Get the trial claimed; answer in tags." in done.stdout

    # one scenario per run: a trainer override naming another one is refused, the same one is accepted
    done, _ = main_sh(tmp_path, "--dry-run", f"rollout_loop.config.scenario={DEFAULT_SCENARIO_PATH}",
                      SCENARIO=str(path))
    assert done.returncode == 2 and "disagrees with SCENARIO" in done.stderr
    done, _ = main_sh(tmp_path, "--dry-run", f"rollout_loop.config.scenario={path}", SCENARIO=str(path))
    assert done.returncode == 0, done.stderr


def test_a_dead_simulator_url_is_reported_before_anything_is_built(tmp_path):
    port = free_port()
    done, wall = main_sh(tmp_path, USER_SIM_URLS=f"http://127.0.0.1:{port}")
    assert done.returncode == 2
    assert f"not answering GET /health within 5 s: 127.0.0.1:{port}" in done.stderr  # named by host:port
    assert not (tmp_path / "outputs").exists() and wall < 30, wall


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)])
def test_a_simulator_url_carrying_credentials_is_refused_without_printing_them(tmp_path, dry_run):
    done, _ = main_sh(tmp_path, *dry_run, USER_SIM_URLS=f"http://127.0.0.1:{free_port()},http://ops:s3cret@sim:1")
    assert done.returncode == 2
    assert "SEAD_USER_SIM_API_KEY" in done.stderr and "s3cret" not in done.stdout + done.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)])
@pytest.mark.parametrize("url, message", [
    ("ftp://sim:5000", "not an http(s)://host[:port] URL"), ("http://sim:99999", "port in 1-65535"),
    ("http://sim:-1", "port in 1-65535"), ("http://sim:5000/v1?token=s3cret", "query string"),
    ("http://sim:5000/x y", "contains a space"), ("http://sim:5000/\"x", "contains a quote"),
])
def test_a_malformed_simulator_url_is_refused_as_the_client_refuses_it(tmp_path, dry_run, url, message):
    done, _ = main_sh(tmp_path, *dry_run, USER_SIM_URLS=f"http://127.0.0.1:{free_port()},{url}")
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "s3cret" not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "outputs").exists()


def test_dry_run_warns_of_a_missing_model_and_of_scripted_users_on_a_gpu_run(tmp_path):
    done, _ = main_sh(tmp_path, "--dry-run", MODEL_PATH=str(tmp_path / "no_such_model"))
    assert done.returncode == 0, done.stderr
    assert f"warning: MODEL_PATH={tmp_path / 'no_such_model'} is not a directory" in done.stderr
    assert "warning: USER_SIM_MODEL is not set: this GPU run's users are the scripted simulators" in done.stderr
    model = tmp_path / "model"
    model.mkdir()
    done, _ = main_sh(tmp_path, "--dry-run", MODEL_PATH=str(model), USER_SIM_MODEL="/models/sim")
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr


def test_plan_plans_the_preset_it_would_run(tmp_path):
    model = tmp_path / "Qwen2.5-7B-Instruct"  # the plan reads only the model's config.json: a 7B's shape
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    done, _ = main_sh(tmp_path, "--plan", MODEL_PATH=str(model), USER_SIM_MODEL="/models/sim")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("preset: gpu (MODEL_PATH is set)")
    # the GPU preset's engine: vLLM, TP 2 at 55% of each of its 6 GPUs (no vLLM installed here)
    assert "28 layers" in done.stdout and "6 GPUs of 80 GB" in done.stdout and "weight sync (vLLM)" in done.stdout
    assert "vLLM engine (TP 2): pool 44.0 GB per GPU (gpu_memory_utilization 0.55)" in done.stdout
