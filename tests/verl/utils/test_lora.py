"""verl.utils.lora without FSDP: settings and their errors, the target-module check, PEFT names, the merged-weight
stream against PEFT's own merge, and the shared-memory model copy (verl.utils.shm_model)."""
from __future__ import annotations

import math
import os

import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from verl.utils import lora as lora_utils
from verl.utils.lora import LoraSettings, apply_lora
from verl.utils.shm_model import shm_model_dir

pytestmark = pytest.mark.oldest  # also under the lowest declared transformers and peft

LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _settings(**model) -> LoraSettings | None:
    return LoraSettings.from_model_config({"lora_rank": 8, "lora_alpha": 16, **model}, "actor_rollout_ref.model")


def test_settings_from_a_model_block():
    assert LoraSettings.from_model_config({"lora_rank": 0}, "m") is None
    assert LoraSettings.from_model_config({}, "m") is None
    s = _settings(target_modules="q_proj", exclude_modules=["v_proj"], lora={"merge": True})
    assert (s.rank, s.alpha, s.target_modules, s.exclude_modules, s.merge) == (8, 16, ("q_proj",), ("v_proj",), True)
    assert s.scaling == 2.0
    assert _settings().target_modules == "all-linear" and _settings().exclude_modules == ()


@pytest.mark.parametrize("model, message", [
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number > 0, got nan"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number > 0, got inf"),
    ({"lora_alpha": 0}, "lora_alpha must be a finite number > 0"),
    ({"lora_alpha": True}, "lora_alpha must be a finite number > 0"),
    ({"lora_rank": -2}, "lora_rank must be a positive integer"),
    ({"lora_rank": 2.5}, "lora_rank must be a positive integer"),
    ({"target_modules": []}, r"actor_rollout_ref.model.target_modules must be all-linear or a non-empty list"),
    ({"target_modules": ["q_proj", ""]}, r"actor_rollout_ref.model.target_modules\[1\] must be a module name"),
    ({"target_modules": ["q_proj", "all-linear"]}, r"target_modules\[1\] must be a module name"),
    ({"exclude_modules": "all-linear"}, r"exclude_modules\[0\] must be a module name"),
    ({"target_modules": ["v_proj", "v_proj"]}, "names a module twice"),
])
def test_bad_settings_are_named(model, message):
    with pytest.raises(ValueError, match=message):
        _settings(**model)


def test_unknown_target_modules_are_named(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert lora_utils.linear_module_names(model) == LINEAR  # the tied LM head is no target
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.target_modules: \['qkv_proj', 'lm_head'\] name no "
                                         r"linear layer of Qwen2ForCausalLM; its linear layers are \['down_proj'"):
        apply_lora(model, _settings(target_modules=["q_proj", "qkv_proj", "lm_head"]), "causal_lm",
                   "actor_rollout_ref.model")
    with pytest.raises(ValueError, match=r"exclude_modules: \['mlp'\]"):
        apply_lora(model, _settings(exclude_modules=["mlp"]), "causal_lm", "actor_rollout_ref.model")


def test_apply_lora_trains_the_adapter_only_in_fp32_beside_a_bf16_base(tiny_model_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    model = apply_lora(base, _settings(exclude_modules=["down_proj"]), "causal_lm", "m")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all(lora_utils.is_adapter_parameter(n) for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    adapted = {n.split(".")[-4] for n in trainable}
    assert adapted == set(LINEAR) - {"down_proj"}
    assert all(p.abs().sum() == 0 for n, p in trainable.items() if ".lora_B." in n)  # starts as the base


def test_value_model_trains_its_head_whole_never_as_a_target(tiny_model_path):
    base = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1)
    model = apply_lora(base, _settings(), "token_cls", "critic.model")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "base_model.model.score.modules_to_save.default.weight" in trainable
    assert not any("score.lora_" in n for n in trainable)


def test_names_agree_with_peft(tiny_model_path):
    """Our name mapping (what the vLLM sync sends) gives PEFT's own saved names and the HF base names."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), _settings(), "causal_lm", "m")
    params = dict(model.named_parameters())
    ours = {lora_utils.adapter_tensor_name(n) for n in params if lora_utils.is_adapter_parameter(n)}
    assert ours == set(get_peft_model_state_dict(model))
    assert set(lora_utils.peft_saved_state(model, {n: p for n, p in params.items() if p.requires_grad})) == ours
    base_names = {lora_utils.base_parameter_name(n) for n in params if not lora_utils.is_adapter_parameter(n)}
    assert base_names == set(dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters()))


def test_merged_weight_stream_equals_peft_merge_and_unload(tiny_model_path):
    torch.manual_seed(0)
    settings = _settings(target_modules=["q_proj", "v_proj", "down_proj"], lora_alpha=12)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), settings, "causal_lm", "m")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.3)
    streamed = dict(lora_utils.merged_weight_stream(
        ((n, p.detach().clone()) for n, p in model.named_parameters()), settings.scaling))
    expected = dict(model.merge_and_unload().named_parameters())
    assert streamed.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(streamed[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
    changed = [n for n in expected if "q_proj.weight" in n or "v_proj.weight" in n or "down_proj.weight" in n]
    assert len(changed) == 6


def test_merged_weight_stream_rejects_a_torn_layer():
    stream = [("base_model.model.l.q_proj.base_layer.weight", torch.zeros(2, 2)),
              ("base_model.model.l.q_proj.lora_A.default.weight", torch.zeros(1, 2))]
    with pytest.raises(ValueError, match="without their base weight or both factors: .*l.q_proj"):
        list(lora_utils.merged_weight_stream(stream, 1.0))


def test_adapter_files_round_trip_and_bad_configs(tmp_path):
    lora_utils.save_adapter(tmp_path, {"a": torch.ones(2)}, {"peft_type": "LORA", "r": 4, "lora_alpha": 8})
    assert lora_utils.read_adapter_config(tmp_path)["r"] == 4 and lora_utils.is_adapter_dir(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": "4"}')
    with pytest.raises(ValueError, match="not a LoRA adapter config"):
        lora_utils.read_adapter_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": ')
    with pytest.raises(ValueError, match="not a readable adapter config"):
        lora_utils.read_adapter_config(tmp_path)


def test_shm_copy_is_made_once_and_renewed_when_the_model_changes(tmp_path, monkeypatch):
    source, root = tmp_path / "model", tmp_path / "shm"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "weights.bin").write_bytes(b"x" * 100)
    first = shm_model_dir(source, root)
    assert first != str(source) and (root / os.path.basename(first) / "sub" / "weights.bin").read_bytes() == b"x" * 100
    assert shm_model_dir(source, root) == first
    (source / "config.json").write_text('{"changed": true}')
    second = shm_model_dir(source, root)
    assert second != first and (root / os.path.basename(second) / "config.json").read_text() == '{"changed": true}'
    assert not list(root.glob(".*partial"))
    monkeypatch.setattr("shutil.disk_usage", lambda _: type("U", (), {"free": 10})())
    (source / "config.json").write_text('{"changed": 2}')
    with pytest.raises(OSError, match=r"use_shm: .* needs 0.0 GiB, .* has 0.0 GiB free; set use_shm=false"):
        shm_model_dir(source, root)
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        shm_model_dir(tmp_path / "missing", root)


def test_scaling_is_alpha_over_rank():
    assert math.isclose(LoraSettings(rank=32, alpha=16).scaling, 0.5)
