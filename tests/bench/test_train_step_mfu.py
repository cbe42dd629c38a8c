"""bench/train_step_flops.py: the peak table and the MFU / HFU arithmetic against hand-computed fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.update_batch import make_batch
from bench.train_step_flops import QWEN25_7B, batch_flops, peak_flops, utilisation
from verl.protocol import DataProto
from verl.utils.memory_model import ModelShape

SHAPE_7B = ModelShape.from_hf_config({**QWEN25_7B, "model_type": "qwen2"})


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H200", 989),
                                          ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA H100 PCIe", 756),
                                          ("NVIDIA A100 80GB PCIe", 312)])
def test_peak_by_device_name(name, tflops):
    peak, source = peak_flops(name)
    assert peak == tflops * 1e12
    assert str(tflops) in source


def test_peak_unknown_device_and_override():
    assert peak_flops("x86_64") == (None, "no peak known for 'x86_64' (pass --peak-tflops)")
    assert peak_flops("x86_64", 2.5) == (2.5e12, "--peak-tflops")
    assert peak_flops("NVIDIA H100 80GB HBM3", 500) == (500e12, "--peak-tflops")
    with pytest.raises(ValueError, match="--peak-tflops"):
        peak_flops("NVIDIA H100", 0)
    assert utilisation(1e15, 2.0, None, 1) is None


def test_mfu_and_hfu_of_the_gpu_preset_by_hand():
    """4 rows of 3,584 + 6,144 tokens, 7B shape, checkpointing, 20 s per update on one H100."""
    data = make_batch(4, 3584, 6144, vocab=SHAPE_7B.vocab_size)
    flops = batch_flops(SHAPE_7B, data, 6144, checkpointing=True)
    # per layer: q, o 3584 x 3584; k, v 3584 x 512 (4 kv heads x 128); gate, up, down 3584 x 18944
    layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944
    assert layer == 233_046_016
    tokens = 4 * 9728
    dense = 2 * 28 * layer * tokens + 2 * 3584 * 152064 * 4 * 6144  # head on the 6,144 response positions
    attention = 4 * 28 * (28 * 128) * 4 * (9728 * 9729 // 2)
    recompute = 2 * 28 * layer * tokens - 2 * 28 * 3584 * 18944 * tokens + attention
    assert flops.model == 3 * (dense + attention)
    assert flops.hardware == 3 * (dense + attention) + recompute
    mfu = utilisation(flops.model, 20.0, peak_flops("NVIDIA H100 80GB HBM3")[0], 1)
    hfu = utilisation(flops.hardware, 20.0, 989e12, 1)
    assert mfu == pytest.approx(3 * (dense + attention) / (20.0 * 989e12), rel=1e-12)
    assert hfu == pytest.approx((3 * (dense + attention) + recompute) / (20.0 * 989e12), rel=1e-12)
    # the magnitudes: ~1.83 PFLOP of model FLOPs per update (9.3 % MFU in 20 s), attention ~12 % of the
    # forward, the recompute +24 %
    assert 1.80e15 < flops.model < 1.86e15
    assert 0.11 < attention / (dense + attention) < 0.13
    assert 1.22 < hfu / mfu < 1.26
    # two GPUs sharing the same batch in the same time: half the utilisation
    assert utilisation(flops.model, 20.0, 989e12, 2) == pytest.approx(mfu / 2)


def test_padding_is_not_counted():
    """Left-padded prompts and right-padded responses: attended tokens per row, scored response positions."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0],    # prompt 2 + response 2 attended (of 4 + 3)
                         [1, 1, 1, 1, 1, 1, 1]])   # all 7
    data = DataProto.from_dict(tensors={"attention_mask": mask})
    small = ModelShape.from_hf_config({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 8,
                                       "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 1})
    flops = batch_flops(small, data, response_length=3, checkpointing=False)
    layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16  # q, o; k, v (1 kv head of 4); the MLP
    # row 0 predicts its 2 attended response tokens, row 1 its 3; 4 and 7 attended tokens
    assert flops.dense_forward == 2 * layer * (4 + 7) + 2 * 8 * 100 * (2 + 3)
    assert flops.attention_forward == 4 * 1 * 8 * (4 * 5 // 2 + 7 * 8 // 2)
    assert flops.recompute_forward == 0


def test_random_model_keeps_the_width_with_fewer_layers(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from bench.train_step_flops import QWEN2_05B, build_random_model

    path = build_random_model("qwen2-0.5b", tmp_path / "m", Path(tiny_model_path), layers=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert config.num_hidden_layers == 1 and config.torch_dtype == torch.bfloat16
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (896, 4864, 151936)
    assert ModelShape.from_model_dir(path).num_params() == model.num_parameters()
    up_proj = model.model.layers[0].mlp.up_proj.weight.detach().float()
    assert 0.01 < float(up_proj.std()) < 0.05  # initialised, not left empty
    with pytest.raises(ValueError, match="--layers"):
        build_random_model("qwen2-0.5b", tmp_path / "n", Path(tiny_model_path), layers=0)
    assert QWEN2_05B["num_hidden_layers"] == 24  # the shape table itself is not changed
