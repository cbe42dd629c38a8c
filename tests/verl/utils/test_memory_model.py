"""The memory model of ``verl.trainer.plan`` against hand-computed shapes and peaks measured on CPU.

Peaks are measured with the torch profiler (``profile_memory=True``): its ``[memory]`` events carry the bytes
allocated since profiling started, so their maximum is the pass's peak above what existed before (weights and,
in the second micro-batch of an update, the gradients). The tolerance is 15%: the model counts the tensors
autograd saves and the logits' copies, not allocator rounding, small index/mask tensors or the exact moment two
temporaries overlap; it is meant to say whether a configuration fits with a safety margin, not to the byte.
"""

from __future__ import annotations

import pytest
import torch

from verl.utils.fsdp_utils import enable_activation_checkpointing
from verl.utils.memory_model import ModelShape, forward_pass_peak, kv_cache_bytes, update_pass_peak
from verl.utils.torch_functional import log_probs_and_entropy
from verl.workers.batching import response_logits

from tests.helpers.memory_profiling import measured_peak
from tests.helpers.small_qwen import SMALL, small_inputs, small_model

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)

QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "tie_word_embeddings": False}
QWEN25_05B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "tie_word_embeddings": True}
LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "tie_word_embeddings": False, "attention_bias": False}
TOLERANCE = 0.15


@pytest.mark.parametrize("config, published", [(QWEN25_7B, 7_615_616_512), (QWEN25_05B, 494_032_768),
                                               (LLAMA3_8B, 8_030_261_248)])
def test_parameter_count_matches_published_model_sizes(config, published):
    assert ModelShape.from_hf_config(config).num_params() == published


def test_hand_computed_7b_figures():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    # K and V: 2 x 28 layers x 4 kv heads x 128 x 2 bytes per token
    assert shape.kv_cache_bytes_per_token(2) == 57_344
    assert kv_cache_bytes(shape, rows=16, context_len=9728, dtype_bytes=2) == 16 * 9728 * 57_344
    # per token and layer, bf16 with K/V repeated to 28 heads: norms 2 x (4h + 4h), attention 2 x (2 x 3584 +
    # 2 x 3584) + 4 x 28 (log-sum-exp), SwiGLU 4 x 2 x 18944
    assert shape.activation_bytes_per_token(2) == 2 * 8 * 3584 + 2 * 4 * 3584 + 112 + 8 * 18944
    # the figure: ~260 GB of activations for 4 x 9728 tokens without checkpointing
    peak = update_pass_peak(shape, rows=4, seq_len=9728, response_len=6144, dtype_bytes=2, checkpointing=False)
    assert 240e9 < peak.activations < 280e9


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(KeyError, match="hidden_size"):
        ModelShape.from_hf_config({"vocab_size": 10})
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelShape.from_model_dir(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_update_peak_matches_measurement(tmp_path, dtype, checkpointing, padded):
    rows, seq_len, response_len = 2, 96, 48
    model = small_model(dtype)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    inputs = small_inputs(rows, seq_len, padded)

    def micro_batch():
        logits = response_logits(model(**inputs, use_cache=False).logits, response_len)
        log_probs, entropy = log_probs_and_entropy(logits, inputs["input_ids"][:, -response_len:], 1.2)
        (-log_probs.mean() - 0.01 * entropy.mean()).backward()

    micro_batch()  # the gradients exist from now on, as in every later micro-batch of a mini-batch
    measured = measured_peak(micro_batch, tmp_path / "trace.json")
    dtype_bytes = torch.finfo(dtype).bits // 8
    shape = ModelShape.from_hf_config(SMALL)
    # HF passes no mask to SDPA for an unpadded batch (K/V stay at the kv heads); a padded batch repeats them
    expected = update_pass_peak(shape, rows, seq_len, response_len, dtype_bytes, checkpointing, repeat_kv=padded,
                                entropy_grad=True)
    assert measured == pytest.approx(expected.total, rel=TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_peak_matches_measurement(tmp_path, dtype):
    rows, seq_len, response_len = 2, 96, 48
    model = small_model(dtype).eval()
    inputs = small_inputs(rows, seq_len, padded=True)

    @torch.no_grad()
    def log_prob_pass():
        logits = response_logits(model(**inputs, use_cache=False).logits, response_len)
        log_probs_and_entropy(logits, inputs["input_ids"][:, -response_len:], 1.2)

    measured = measured_peak(log_prob_pass, tmp_path / "trace.json")
    shape = ModelShape.from_hf_config(SMALL)
    expected = forward_pass_peak(shape, rows, seq_len, response_len, torch.finfo(dtype).bits // 8)
    assert measured == pytest.approx(expected.total, rel=TOLERANCE)


def test_kv_cache_matches_generate(tmp_path):
    model = small_model(torch.float32).eval()
    inputs = small_inputs(2, 20, padded=False)
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=True)
    cache = out.past_key_values
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert cache_bytes == kv_cache_bytes(ModelShape.from_hf_config(SMALL), rows=2, context_len=20, dtype_bytes=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_saved_activations_per_layer_match_the_formula(dtype, padded):
    """The decoder stack's activations alone (no logits): the bytes of every distinct storage autograd saves."""
    rows, seq_len = 2, 96
    model = small_model(dtype).train()
    inputs = small_inputs(rows, seq_len, padded)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(**inputs, use_cache=False)
    shape = ModelShape.from_hf_config(SMALL)
    dtype_bytes = torch.finfo(dtype).bits // 8
    per_layer = shape.activation_bytes_per_token(dtype_bytes, repeat_kv=padded) * rows * seq_len
    # the stack plus the final norm (fp32 copy, normed output and its cast)
    expected = shape.num_layers * per_layer + rows * seq_len * (4 + 2 * dtype_bytes) * shape.hidden_size
    assert sum(saved.values()) == pytest.approx(expected, rel=0.10)
