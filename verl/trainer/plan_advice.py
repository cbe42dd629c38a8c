"""The planner's advice: the settings to change for the phases of a step that do not fit on the GPU, and for a
vLLM KV cache too small for the step's dialogues."""
from __future__ import annotations

from verl.trainer.plan_phases import forward_phase, rollout_phase, update_phase, vllm_engine
from verl.trainer.plan_setup import (GB, Hardware, Phase, Setup, forward_token_budget, resident_bytes,
                                     update_token_budget)


def _largest_fitting(build, current: int, limit: float, smallest: int = 1, step: int = 1) -> int:
    """The largest value <= ``current`` (down to ``smallest``, by ``step``) whose phase fits in ``limit`` bytes (0
    if none does)."""
    for value in range(current, smallest - 1, -step):
        if build(value).total <= limit:
            return value
    return 0


def _vllm_advice(s: Setup, hw: Hardware, phase: Phase) -> list[str]:
    """Settings to change when the engine does not fit beside the actor or its KV cache cannot hold the step."""
    a, key = s.cfg.actor_rollout_ref, "actor_rollout_ref.rollout"
    engine = vllm_engine(s, hw)
    room = hw.memory_bytes - (phase.total - engine.pool)  # what the actor's resident state leaves
    util_max = int(room / hw.memory_bytes * 100) / 100
    best = vllm_engine(s, hw, util_max)
    advice = []
    if phase.total > hw.memory_bytes:
        advice.append(f"{phase.name}: the engine's pool does not fit beside the actor's resident state "
                      f"({(phase.total - engine.pool) / GB:.1f} GB): set {key}.gpu_memory_utilization={util_max:g} "
                      f"(now {a.rollout.gpu_memory_utilization:g})")
    if engine.kv_tokens < engine.max_len:
        advice.append(f"{phase.name}: the KV cache ({engine.kv_tokens:,} tokens) cannot hold one dialogue of "
                      f"{engine.max_len:,} tokens and vLLM refuses to start: raise {key}.gpu_memory_utilization "
                      f"(at most {util_max:g} here) or {key}.tensor_model_parallel_size")
    elif engine.kv_tokens < engine.peak_tokens and not advice:
        options = []
        if util_max > a.rollout.gpu_memory_utilization:
            options.append(f"set {key}.gpu_memory_utilization={util_max:g} (the most beside the actor: "
                           f"{best.kv_tokens:,} tokens)")
        if phase.memory.get("optimizer", 0.0) > 0:
            options.append(f"set actor_rollout_ref.actor.fsdp_config.optimizer_offload=true (frees "
                           f"{phase.memory['optimizer'] / GB:.1f} GB of AdamW state while generating, for a larger "
                           f"gpu_memory_utilization)")
        fit = max(1, engine.kv_tokens // engine.max_len)
        options.append(f"or set {key}.max_num_seqs={fit} so that the running dialogues fit at full length (the "
                       f"others wait instead of being preempted)")
        advice.append(f"{phase.name}: the KV cache holds {engine.kv_tokens:,} of up to {engine.peak_tokens:,} "
                      f"dialogue tokens: " + "; ".join(options))
    return advice


def advise(s: Setup, hw: Hardware, phases: list[Phase]) -> list[str]:
    """Settings to change for the phases that do not fit in ``hw.memory_bytes`` (and a vLLM KV cache too small
    for the step's dialogues)."""
    a, limit, advice = s.cfg.actor_rollout_ref, hw.memory_bytes, []
    resident = sum(resident_bytes(s, "update actor").values())
    if resident > limit:
        advice.append(f"the sharded weights and optimizer states alone need {resident / GB:.1f} GB per GPU: raise "
                      f"trainer.n_gpus_per_node / trainer.nnodes (now {s.world} GPUs), or offload parameters and "
                      "optimizer states to the CPU (fsdp_config.param_offload / optimizer_offload)")
        return advice
    knobs = {
        "rollout": ("actor_rollout_ref.rollout.micro_batch_size_per_gpu", a.rollout.micro_batch_size_per_gpu,
                    lambda m: rollout_phase(s, hw, m)),
        "old": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                a.rollout.log_prob_micro_batch_size_per_gpu, lambda m: forward_phase(s, hw, "", "actor", m)),
        "reference": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                      a.ref.log_prob_micro_batch_size_per_gpu, lambda m: forward_phase(s, hw, "", "ref", m)),
        "values": ("critic.forward_micro_batch_size_per_gpu", s.cfg.critic.forward_micro_batch_size_per_gpu,
                   lambda m: forward_phase(s, hw, "", "critic", m)),
    }
    budget_keys = {"old": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                   "reference": "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                   "values": "critic.forward_max_token_len_per_gpu"}
    for phase in phases:
        head = phase.name.split()[0]
        if phase.name == "rollout (vLLM)":
            advice += _vllm_advice(s, hw, phase)
            continue
        if phase.total <= limit:
            continue
        if head == "weight":
            advice.append(f"{phase.name}: lower actor_rollout_ref.rollout.update_weights_bucket_megabytes (now "
                          f"{a.rollout.update_weights_bucket_megabytes:g}) or offload the optimizer "
                          "(actor_rollout_ref.actor.fsdp_config.optimizer_offload=true)")
            continue
        if head == "update":
            advice.append(_update_advice(s, hw, phase, limit))
            continue
        key, now, build = knobs[head]
        model = {"old": "actor", "reference": "ref", "values": "critic"}.get(head)
        dynamic, budget = forward_token_budget(s, model) if model else (False, 0)
        if dynamic:
            key, now = budget_keys[head], budget
            fit = _largest_fitting(lambda t: forward_phase(s, hw, "", model, 1, t), budget, limit, s.seq_len, 1024)
        else:
            fit = _largest_fitting(build, now, limit)
        critic_hint = ("; or keep the critic off the GPU outside its phases (critic.model.fsdp_config.param_offload "
                       "/ optimizer_offload)") if s.critic is not None and head != "values" else ""
        if fit:
            advice.append(f"{phase.name}: set {key}={fit} (now {now}){critic_hint}")
        else:
            advice.append(f"{phase.name}: does not fit even with one row per micro-batch: add GPUs or shorten the "
                          "sequences")
    return advice


def _update_advice(s: Setup, hw: Hardware, phase: Phase, limit: float) -> str:
    """What to change for an update phase that does not fit."""
    a = s.cfg.actor_rollout_ref
    model = phase.name.split()[1]
    ckpt = (s.cfg.critic.model if model == "critic" else a.model).enable_gradient_checkpointing
    prefix = "critic" if model == "critic" else "actor_rollout_ref"
    section_key = "critic" if model == "critic" else "actor_rollout_ref.actor"
    micro_now = (s.cfg.critic if model == "critic" else a.actor).ppo_micro_batch_size_per_gpu
    dynamic, budget = update_token_budget(s, model)
    if not ckpt and update_phase(s, hw, model, micro_now, True).total <= limit:
        return f"{phase.name}: set {prefix}.model.enable_gradient_checkpointing=true"
    if dynamic:
        fit = _largest_fitting(lambda t: update_phase(s, hw, model, 1, True, t), budget, limit, s.seq_len, 1024)
        setting = f"{section_key}.ppo_max_token_len_per_gpu={fit}"
    else:
        fit = _largest_fitting(lambda m: update_phase(s, hw, model, m, True), micro_now, limit)
        setting = f"{section_key}.ppo_micro_batch_size_per_gpu={fit}"
    if fit:
        return f"{phase.name}: set {prefix}.model.enable_gradient_checkpointing=true and {setting}"
    return (f"{phase.name}: one row of {s.seq_len} tokens does not fit even with checkpointing: shorten "
            "data.max_prompt_length / max_response_length, add GPUs, or offload the optimizer "
            "(fsdp_config.optimizer_offload)")
