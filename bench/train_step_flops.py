"""Model shapes, random-weight checkpoints, the MFU / HFU arithmetic and the planner's memory expectation of
``bench/train_step.py``.

MFU = model FLOPs / (seconds x peak FLOP/s of one device x devices); HFU uses the hardware FLOPs instead, which add
the forward that gradient checkpointing recomputes. The FLOPs are :func:`verl.utils.memory_model.pass_flops`:

* dense: 2 x the decoder layers' matmul weights x every attended token + 2 x hidden x vocab x the positions
  that go through the LM head (those predicting a response token; the embedding is a lookup, 0 FLOPs);
* attention (causal): 4 x layers x heads x head_dim x T(T+1)/2 per sequence of T attended tokens (QK^T and PV,
  2 x head_dim FLOPs per query-key pair each); backward = 2 x forward for both;
* recompute (HFU only): each decoder layer's forward again, attention included, without the MLP's down
  projection (non-reentrant checkpointing stops once the last saved tensor is regenerated).
"""
from __future__ import annotations

from pathlib import Path

from verl.protocol import DataProto
from verl.utils.memory_model import ModelShape, PassFlops, pass_flops

# Dense (no sparsity) bf16 peak FLOP/s by device-name fragment, from the vendors' data sheets; the first
# fragment contained in the device name wins, so the more specific names come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("4090", 165.0),
)

# Qwen2.5-7B-Instruct's config.json shape (the SEAD paper's 7B policy) and Qwen2-0.5B's.
QWEN25_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
             "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
QWEN2_05B = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
             "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
SHAPES = {"qwen2.5-7b": QWEN25_7B, "qwen2-0.5b": QWEN2_05B}


def peak_flops(device_name: str, override_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s of one device, where the number comes from); (None, reason) when unknown."""
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"--peak-tflops must be > 0, got {override_tflops}")
        return override_tflops * 1e12, "--peak-tflops"
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in device_name:
            return tflops * 1e12, f"table: {fragment} {tflops:g} TFLOP/s"
    return None, f"no peak known for {device_name!r} (pass --peak-tflops)"


def utilisation(flops: float, seconds: float, peak: float | None, devices: int) -> float | None:
    """``flops / (seconds x peak x devices)``, or None without a peak."""
    if peak is None:
        return None
    return flops / (seconds * peak * devices)


def batch_flops(shape: ModelShape, data: DataProto, response_length: int, checkpointing: bool) -> PassFlops:
    """:class:`PassFlops` of one pass over ``data`` (padded layout, the last ``response_length`` columns the
    responses): attended tokens per row, and as head positions those predicting an attended response token."""
    mask = data.batch["attention_mask"].bool()
    width = mask.shape[1]
    scored = mask[:, width - response_length - 1:width - 1] & mask[:, width - response_length:]
    return pass_flops(shape, [int(n) for n in mask.sum(dim=1)], int(scored.sum()), checkpointing)


def build_random_model(shape_name: str, out_dir: Path, tokenizer_dir: Path, layers: int | None = None) -> Path:
    """Write a random-weight bf16 Qwen2 checkpoint of ``SHAPES[shape_name]`` (depth ``layers`` when given; the
    width is kept) with the tokenizer of ``tokenizer_dir``; built from the config alone, no hub access."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if shape_name not in SHAPES:
        raise ValueError(f"unknown model shape {shape_name!r}; expected one of {sorted(SHAPES)}")
    kwargs = dict(SHAPES[shape_name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        kwargs["num_hidden_layers"] = layers
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**kwargs), torch_dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def planned_memory_mib(overrides: list[str]) -> dict[str, float]:
    """The memory planner's (``python -m verl.trainer.plan``) per-GPU estimate, in MiB, of the bench's two phases
    (``log_prob``: the old-log-prob pass, ``update``: the actor update) for the trainer config ``overrides`` (with
    ``trainer.n_gpus_per_node`` the worker count), actor only, without the CUDA context, which the allocator's
    counters do not see. The planner assumes CUDA's bf16 compute dtype."""
    from verl.trainer import plan_phases, plan_setup
    from verl.trainer.config_schema import compose_config
    from verl.trainer.config_validation import build_config

    cfg = build_config(compose_config(overrides))
    actor = cfg.actor_rollout_ref
    setup = plan_setup.make_setup(cfg, ModelShape.from_model_dir(actor.model.path), None)
    hw = plan_setup.Hardware()
    phases = {"log_prob": plan_phases.forward_phase(setup, hw, "old log-probs", "actor",
                                                    actor.rollout.log_prob_micro_batch_size_per_gpu),
              "update": plan_phases.update_phase(setup, hw, "actor", actor.actor.ppo_micro_batch_size_per_gpu,
                                                 actor.model.enable_gradient_checkpointing)}
    return {name: (phase.total - phase.memory.get("cuda contexts", 0.0)) / 2**20 for name, phase in phases.items()}
