"""The hostile-checkpoint probes of issue 42 rerun on every path that opens a trainer checkpoint (the model merger,
the evaluation's checkpoint agent, the trainer's resume and its workers' load): a crafted `.metadata` runs no code
(a marker file stays absent) whether the manifest is kept, rewritten or missing with the trust flag; sizes in
config.json or the metadata are checked before anything is allocated; every refusal is one line."""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from verl.model_merger import main as merger_main
from verl.trainer.config_schema import ConfigError, TrainerConfig
from verl.trainer.ppo.trainer_checkpoint import TrainerCheckpoints
from verl.utils.checkpoint_manifest import MANIFEST_FILE, write_manifest
from verl.utils.safe_dcp import CheckpointFormatError

from tests.helpers.checkpoint_fixtures import write_checkpoint
from tests.helpers.for_evaluation_cli import load_script
from tests.helpers.repo import REPO

pytestmark = pytest.mark.processes


class MarkerPayload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_model_path, tmp_path_factory) -> Path:
    """A checkpoint root written by the real actor worker (no HF export: the weights are in sharded_state/)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    write_checkpoint(tiny_model_path, root, step=1, hf_export=False)
    return root


@pytest.fixture()
def hostile(saved_checkpoint, tmp_path):
    """A copy of the checkpoint root whose actor/sharded_state/.metadata creates `marker` when unpickled."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, root)
    marker = tmp_path / "marker"
    (root / "global_step_1" / "actor" / "sharded_state" / ".metadata").write_bytes(pickle.dumps(MarkerPayload(marker)))
    return root, marker


def _manifest(actor: Path, how: str) -> list[str]:
    """Leave the manifest (`kept`), rewrite it as an attacker would (`rewritten`) or delete it with the trust
    flag given (`missing+trust`); returns the merger's extra arguments."""
    if how == "rewritten":
        write_manifest(actor)
    elif how == "missing+trust":
        (actor / MANIFEST_FILE).unlink()
        return ["--trust_checkpoint"]
    return []


def _merge(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        merger_main(argv)
    return str(exc.value.code)


@pytest.mark.parametrize("how, match", [("kept", "its manifest says"), ("rewritten", "refers to io.open"),
                                        ("missing+trust", "refers to io.open")])
def test_the_merger_runs_no_code_from_a_crafted_metadata(hostile, tmp_path, how, match):
    root, marker = hostile
    actor = root / "global_step_1" / "actor"
    message = _merge(["--local_dir", str(actor), "--target_dir", str(tmp_path / "out"), *_manifest(actor, how)])
    assert message.startswith("model_merger: ") and match in message and "\n" not in message
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_merger_command_prints_one_line_and_no_traceback(hostile, tmp_path):
    root, marker = hostile
    actor = root / "global_step_1" / "actor"
    (actor / MANIFEST_FILE).unlink()
    proc = subprocess.run([sys.executable, "-m", "verl.model_merger", "--local_dir", str(actor), "--target_dir",
                           str(tmp_path / "out"), "--trust_checkpoint"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("model_merger: ") and not marker.exists()


@pytest.mark.parametrize("how, match", [("kept", "its manifest says"), ("rewritten", "refers to io.open"),
                                        ("missing+trust", "refers to io.open")])
def test_the_evaluation_runs_no_code_from_a_crafted_metadata(hostile, tmp_path, how, match):
    root, marker = hostile
    trust = ["--trust-checkpoint"] if _manifest(root / "global_step_1" / "actor", how) else []
    evaluate = load_script("evaluate")
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--agent", f"rl={root}", "--test-file", str(tmp_path / "test.parquet"), "--user-sim-urls",
                       "http://127.0.0.1:9", "--engine", "hf", "--out", str(tmp_path / "eval"), *trust])
    message = str(exc.value.code)
    assert message.startswith("evaluate: ") and match in message and "\n" not in message
    assert not marker.exists()


def test_a_resume_skips_the_crafted_checkpoint_before_any_worker(hostile):
    root, marker = hostile
    with pytest.raises(ConfigError, match="sharded_state/.metadata has .* bytes, its manifest says") as err:
        TrainerCheckpoints(TrainerConfig(default_local_dir=str(root)), "model").to_resume()
    assert "\n" not in str(err.value) and not marker.exists()


@pytest.fixture()
def single_rank_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_workers_load_runs_no_code_even_from_a_trusted_checkpoint(hostile, tiny_model_path,
                                                                      single_rank_process_group):
    from tests.helpers.ppo_batch_helpers import actor_rollout_ref_config
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    root, marker = hostile
    worker = ActorRolloutRefWorker(actor_rollout_ref_config(tiny_model_path), role="actor_rollout_ref")
    worker.init_model()
    with pytest.raises(CheckpointFormatError, match="refers to io.open"):
        worker.load_checkpoint(str(root / "global_step_1" / "actor"))
    assert not marker.exists()


def _edit_config(actor: Path, **changes) -> None:
    config = json.loads((actor / "config.json").read_text())
    config.update(changes)
    (actor / "config.json").write_text(json.dumps(config))
    write_manifest(actor)  # as if saved so: the checks below are the merger's, not the manifest's


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": 10**9}, r"lm_head.weight is \[1024, 64\] in the checkpoint, \[1024, 1000000000\] in the model"),
    ({"vocab_size": 10**12}, "the weights do not match config.json's model"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 is impossible for a checkpoint of 27 tensors"),
    ({"num_hidden_layers": 28}, "num_hidden_layers=28 is impossible for a checkpoint of 27 tensors"),
    ({"architectures": "Qwen2ForCausalLM"}, "'architectures' must be a list"),
    ({"architectures": [123]}, "'architectures' must be a list"),
    ({"architectures": ["os.system"]}, "names no transformers model class"),
    ({"architectures": ["PreTrainedModel"]}, "names no transformers model class"),
    ({"architectures": ["AutoTokenizer"]}, "names no transformers model class"),
    ({"model_type": "no-such-model"}, "no config transformers can use"),
    ({"num_attention_heads": 0}, "does not describe a model transformers can build|no config transformers can use"),
])
def test_the_merger_checks_config_sizes_against_the_weights(saved_checkpoint, tmp_path, changes, match):
    root = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, root)
    actor = root / "global_step_1" / "actor"
    _edit_config(actor, **changes)
    message = _merge(["--local_dir", str(actor), "--target_dir", str(tmp_path / "out")])
    assert message.startswith("model_merger: ") and "\n" not in message
    assert re.search(match, message), message
    assert not (tmp_path / "out").exists()


def test_the_merger_logs_the_tensors_it_wrote(saved_checkpoint, tmp_path, caplog):
    caplog.set_level("INFO")
    assert merger_main(["--local_dir", str(saved_checkpoint / "global_step_1" / "actor"), "--target_dir",
                        str(tmp_path / "out")]) is None
    assert "(27 tensors, the training dtype)" in caplog.text
