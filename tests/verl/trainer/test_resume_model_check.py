"""Resuming refuses a checkpoint trained from another model (unless forced); the model is known by its content.

Real runs of the built-in task on the tiny model: train one step from model A and save; resuming that
checkpoint with model B (A's weights changed, at another path) fails before any worker starts, naming both paths
and the override; a copy of A at another path (a moved checkout) resumes; with
trainer.resume_from_other_model=true B resumes and trains on; a checkpoint that does not record its model (older)
resumes with a warning. A model rebuilt at the checkpoint's own path is refused too (before, it resumed without a
word: only the path was recorded).
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from verl.trainer.config_schema import ConfigError
from verl.trainer.ppo.trainer_checkpoint import check_same_model
from verl.utils.run_config import load_run_config


def _overrides(model: Path, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.max_response_length=4",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.n_gpus_per_node=1",
            "trainer.device=cpu", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out / 'ckpt'}",
            f"trainer.log_dir={out / f'logs_{steps}'}", "trainer.val_before_train=false", *extra]


def _state(out: Path, step: int) -> dict:
    return json.loads((out / "ckpt" / f"global_step_{step}" / "trainer_state.json").read_text())


def _trained_steps(out: Path, steps: int) -> list[int]:
    lines = (out / f"logs_{steps}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_check_same_model_branches(tmp_path, caplog):
    ckpt = tmp_path / "global_step_3"
    with pytest.raises(ConfigError) as err:
        check_same_model(ckpt, {"model_path": "/models/a"}, "/models/b", allow_other=False)
    assert str(err.value) == (
        f"checkpoint {ckpt} was trained from actor_rollout_ref.model.path='/models/a', but this run's model is "
        "'/models/b'; use another trainer.experiment_name / trainer.default_local_dir for a new run, or set "
        "trainer.resume_from_other_model=true to resume it anyway")
    with caplog.at_level(logging.WARNING):
        check_same_model(ckpt, {"model_path": "/models/a"}, "/models/b", allow_other=True)
        check_same_model(ckpt, {"global_step": 3}, "/models/b", allow_other=False)
        check_same_model(ckpt, {"model_path": "/models/b"}, "/models/b", allow_other=False)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "trainer.resume_from_other_model=true allows" in messages[0]
    assert "does not record the model it was trained from" in messages[1]


def _model_dir(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_the_fingerprint_is_the_weights_not_the_path(tmp_path):
    from verl.utils.content_digest import SAMPLE_BYTES, model_fingerprint

    big = bytes(range(256)) * (4 * SAMPLE_BYTES // 256)  # 4 MiB: sampled at its start, middle and end
    model = _model_dir(tmp_path / "a" / "warm", big)
    fingerprint = model_fingerprint(model)
    shutil.copytree(model, tmp_path / "b" / "warm")
    assert model_fingerprint(tmp_path / "b" / "warm") == fingerprint  # a copied checkout
    (tmp_path / "b" / "warm" / "tokenizer.json").write_text('{"x": 1}')
    assert model_fingerprint(tmp_path / "b" / "warm") == fingerprint  # the tokenizer is checked on its own
    middle = bytearray(big)
    middle[len(big) // 2] ^= 1
    (model / "model.safetensors").write_bytes(bytes(middle))
    assert model_fingerprint(model) != fingerprint  # rebuilt in place
    assert model_fingerprint(_model_dir(tmp_path / "small", b"x")) != model_fingerprint(_model_dir(tmp_path / "s2", b"y"))
    assert model_fingerprint(tmp_path / "nowhere") is None and model_fingerprint(tmp_path / "a") is None


def test_check_same_model_by_content(tmp_path, caplog):
    ckpt = tmp_path / "global_step_3"
    state = {"model_path": "/old/checkout/outputs/warm", "model_fingerprint": "f1"}
    with caplog.at_level(logging.INFO, logger="verl.trainer.ppo.trainer_checkpoint"):
        check_same_model(ckpt, state, "/new/checkout/outputs/warm", False, "f1")  # moved: the same weights
    assert any("the same weights as actor_rollout_ref.model.path=/new/checkout" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError) as err:
        check_same_model(ckpt, {**state, "model_path": "/m"}, "/m", False, "f2")
    assert str(err.value).startswith(f"checkpoint {ckpt} was trained from actor_rollout_ref.model.path='/m', whose "
                                     "weights have changed since (the model was rebuilt or replaced there)")
    assert "trainer.resume_from_other_model=true" in str(err.value)
    with pytest.raises(ConfigError, match=r"but this run's model is '/other' \(other weights\)"):
        check_same_model(ckpt, state, "/other", False, "f2")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_same_model(ckpt, {**state, "model_path": "/m"}, "/m", True, "f2")
    assert "as trainer.resume_from_other_model=true allows" in caplog.records[-1].getMessage()


@pytest.mark.slow
@pytest.mark.extended  # 35 s measured: make test-extended (CI), kept out of make test's 20 minutes
def test_resume_from_another_model_fails_unless_forced(tiny_model_path, tmp_path, ray_cluster, caplog):
    from transformers import AutoTokenizer

    from verl.tasks.repeat_letter import make_dataset
    from verl.trainer.config_schema import compose_config
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.content_digest import model_fingerprint

    data, out = tmp_path / "data", tmp_path / "run"
    make_dataset(data, train_size=16, val_size=4, seed=0)
    model_a = Path(tiny_model_path)
    model_b = tmp_path / "other_model"  # A's weights changed: another model
    shutil.copytree(model_a, model_b)
    weights = bytearray((model_b / "model.safetensors").read_bytes())
    weights[-5] ^= 1
    (model_b / "model.safetensors").write_bytes(bytes(weights))
    moved = tmp_path / "moved" / model_a.name  # A in a moved checkout: the same weights
    shutil.copytree(model_a, moved)

    run_ppo(compose_config(_overrides(model_a, data, out, 1)))
    assert _state(out, 1)["model_path"] == str(model_a.resolve())
    recorded = load_run_config(out / "ckpt" / "global_step_1")  # the run's own config, for evaluations
    assert recorded.select("actor_rollout_ref.model.path") == str(model_a.resolve())
    assert recorded.select("data.max_response_length") == 4 and recorded.select("trainer.total_training_steps") == 1

    with pytest.raises(ConfigError) as err:
        run_ppo(compose_config(_overrides(model_b, data, out, 2)))
    message = str(err.value)
    assert str(model_a.resolve()) in message and str(model_b.resolve()) in message
    assert "trainer.resume_from_other_model=true" in message
    assert not (out / "ckpt" / "global_step_2").exists() and not (out / "logs_2").exists()

    model_c = tmp_path / "other_tokenizer"  # model A with one more token: the tokenizer check refuses even a forced resume
    shutil.copytree(model_a, model_c)
    tokenizer = AutoTokenizer.from_pretrained(model_c)
    tokenizer.add_tokens(["<pizza>"])
    tokenizer.save_pretrained(model_c)
    with pytest.raises(ConfigError, match="trained with a different tokenizer"):
        run_ppo(compose_config(_overrides(model_c, data, out, 2, "trainer.resume_from_other_model=true")))
    assert not (out / "logs_2").exists()

    run_ppo(compose_config(_overrides(moved, data, out, 2)))
    assert _trained_steps(out, 2) == [2], "the moved model must continue from step 1"

    run_ppo(compose_config(_overrides(model_b, data, out, 3, "trainer.resume_from_other_model=true")))
    assert _trained_steps(out, 3) == [3], "the forced resume must continue from step 2"
    assert _state(out, 3)["model_path"] == str(model_b.resolve())
    assert _state(out, 3)["model_fingerprint"] == model_fingerprint(model_b) != model_fingerprint(model_a)

    older = out / "ckpt" / "global_step_3" / "trainer_state.json"
    state = json.loads(older.read_text())
    del state["model_path"], state["model_fingerprint"]  # what a checkpoint written before the records holds
    older.write_text(json.dumps(state))
    for manifest in (older.parent / "checkpoint_manifest.json", older.parent / "actor" / "checkpoint_manifest.json",
                     out / "ckpt" / "manifest_digests.json"):
        manifest.unlink()  # ... and before checkpoints had manifests: opened only when trusted
    with pytest.raises(ConfigError, match="has no checkpoint_manifest.json .* trainer.trust_checkpoint=true"):
        run_ppo(compose_config(_overrides(model_a, data, out, 4, "trainer.resume_mode=resume_path",
                                          f"trainer.resume_from_path={older.parent}")))
    with caplog.at_level(logging.WARNING, logger="verl.trainer.ppo.trainer_checkpoint"):
        run_ppo(compose_config(_overrides(model_a, data, out, 4, "trainer.trust_checkpoint=true")))
    assert _trained_steps(out, 4) == [4]
    assert any("does not record the model it was trained from" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_of_another_tokenizer_or_scenario_is_refused_with_the_reason(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from llm_agent.scenario import DEFAULT_SCENARIO_PATH
    from verl.trainer.ppo.trainer_checkpoint import check_same_inputs, run_inputs

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    recorded = run_inputs(tokenizer, str(DEFAULT_SCENARIO_PATH))
    # relative to the repository root, as the trainer's config names it; the digest is of the file's bytes
    repo = Path(__file__).resolve().parents[3]
    assert run_inputs(tokenizer, str(DEFAULT_SCENARIO_PATH.relative_to(repo))) == recorded
    assert recorded["scenario"] == hashlib.sha256(DEFAULT_SCENARIO_PATH.read_bytes()).hexdigest()
    edited = tmp_path / "edited.yaml"
    edited.write_bytes(DEFAULT_SCENARIO_PATH.read_bytes() + b"\n# a comment\n")
    tokenizer.add_tokens(["<pizza>"])  # what a new scenario's tag does to the tiny model's tokenizer
    ckpt = tmp_path / "global_step_4"
    state = {"global_step": 4, "run_inputs": recorded}
    check_same_inputs(ckpt, state, recorded)
    check_same_inputs(ckpt, {"global_step": 4}, recorded)  # an older checkpoint records none
    with pytest.raises(ConfigError, match=r"a different tokenizer \(its vocabulary\) from this run's: resuming it "
                                          r"would train on tokens it does not know"):
        check_same_inputs(ckpt, state, run_inputs(tokenizer, str(DEFAULT_SCENARIO_PATH)))
    with pytest.raises(ConfigError) as err:
        check_same_inputs(ckpt, state, {**recorded, "scenario": run_inputs(tokenizer, str(edited))["scenario"]})
    assert "a different scenario (rollout_loop.config.scenario's content)" in str(err.value)
    assert "trainer.experiment_name" in str(err.value) and str(ckpt) in str(err.value)
