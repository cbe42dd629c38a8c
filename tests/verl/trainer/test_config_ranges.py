"""Out-of-range config values and broken interpolations are refused at load, naming the key (issue 12, item 13)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config

REPO = Path(__file__).resolve().parents[3]
A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"


@pytest.mark.parametrize("override, message", [
    (f"{A}.optim.lr=inf", rf"{A}\.optim\.lr must be a finite number, got inf"),
    (f"{A}.optim.lr=nan", rf"{A}\.optim\.lr must be a finite number, got nan"),
    (f"{A}.optim.lr=-0.001", rf"{A}\.optim\.lr=-0\.001 is outside \[0, inf\)"),
    ("critic.optim.lr=-1e-5", r"critic\.optim\.lr=-1e-05 is outside"),
    (f"{A}.optim.betas=[0.9]", rf"{A}\.optim\.betas must be two numbers"),
    (f"{A}.optim.betas=[0.9,1.0]", rf"{A}\.optim\.betas\[1\]=1\.0 is outside \[0, 1\)"),
    (f"{A}.optim.weight_decay=-0.1", rf"{A}\.optim\.weight_decay"),
    (f"{R}.temperature=-0.5", rf"{R}\.temperature=-0\.5 is outside"),
    (f"{R}.top_p=0", rf"{R}\.top_p=0\.0 is outside \(0, 1\]"),
    (f"{R}.top_p=1.5", rf"{R}\.top_p=1\.5 is outside \(0, 1\]"),
    (f"{R}.val_kwargs.top_p=-1", rf"{R}\.val_kwargs\.top_p"),
    (f"{R}.top_k=-2", rf"{R}\.top_k must be -1"),
    ("algorithm.gamma=1.5", r"algorithm\.gamma=1\.5 is outside \[0, 1\]"),
    ("algorithm.lam=-0.1", r"algorithm\.lam=-0\.1 is outside \[0, 1\]"),
    ("algorithm.kl_ctrl.kl_coef=-1", r"algorithm\.kl_ctrl\.kl_coef"),
    (f"{A}.clip_ratio=0", rf"{A}\.clip_ratio=0\.0 is outside \(0, inf\)"),
    (f"{A}.clip_ratio_c=1.0", rf"{A}\.clip_ratio_c=1\.0 is outside \(1, inf\)"),
    (f"{A}.grad_clip=nan", rf"{A}\.grad_clip must be a finite number"),
    ("trainer.ray_num_cpus=-2", r"trainer\.ray_num_cpus must be >= 0 or null, got -2"),
    ("trainer.default_local_dir=''", r"trainer\.default_local_dir must be a non-empty path"),
])
def test_out_of_range_values_name_the_key(paths, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(compose_config(paths + [override]))


def test_in_range_edge_values_pass(paths):
    cfg = load_config(compose_config(paths + [
        f"{A}.optim.lr=0", f"{R}.temperature=0", f"{R}.top_p=1.0", "algorithm.gamma=0", "algorithm.lam=1",
        "trainer.ray_num_cpus=0", f"{A}.clip_ratio_low=null", f"{A}.optim.betas=[0.0,0.999]"]))
    assert cfg.actor_rollout_ref.actor.optim.lr == 0.0 and cfg.algorithm.gamma == 0.0


def test_broken_interpolation_is_a_config_error_naming_the_key(paths):
    with pytest.raises(ConfigError, match=r"trainer\.default_local_dir: .*nowhere"):
        load_config(compose_config(paths + ["trainer.default_local_dir=${nowhere.dir}"]))


@pytest.mark.processes
@pytest.mark.parametrize("override, needle", [
    (f"{A}.optim.lr=inf", f"config error: {A}.optim.lr must be a finite number, got inf"),
    ("trainer.log_dir=${oops}", "config error: trainer.log_dir: "),
])
def test_entry_point_prints_one_config_error_line(paths, override, needle, tmp_path):
    result = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *paths, override,
                             f"hydra.run.dir={tmp_path}/hydra"],
                            cwd=REPO, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"})
    assert result.returncode == 1, result.stderr[-2000:]
    assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


@pytest.mark.processes
def test_the_entry_point_imports_ray_and_torch_only_after_the_config_is_valid():
    probe = ("import sys, verl.trainer.main_ppo; "
             "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                            check=True)
    assert result.stdout.strip() == "[]", "a config error must not wait for torch and Ray to import"
