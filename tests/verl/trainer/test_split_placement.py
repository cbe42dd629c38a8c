"""Split placement (``actor_rollout_ref.rollout.n_gpus_per_node`` > 0): the config's refusals, and a rollout group of
its own that, after a sync, holds exactly the actor's updated weights (compared with the actor's HF export, read by
transformers) and generates what a plain HF model with those weights generates, reporting the installed version."""
from __future__ import annotations

import pytest
import torch

from omegaconf import OmegaConf

from tests.helpers.ppo_batch_helpers import RESPONSE_LEN, actor_rollout_ref_config, make_ppo_batch, make_prompts
from verl.trainer.config_schema import ConfigError, compose_config
from verl.trainer.config_validation import load_config


def _config(*overrides: str):
    return load_config(compose_config(["actor_rollout_ref.model.path=/nonexistent", "data.train_files=x",
                                       *overrides]), check_paths=False)


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.n_gpus_per_node=-1"], r"n_gpus_per_node=-1 is outside \[0"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=nan"], "n_gpus_per_node"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=1.5"], "n_gpus_per_node"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=inf"], "n_gpus_per_node"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=3", "actor_rollout_ref.rollout.name=vllm",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "make it a multiple of 2"),
])
def test_split_placement_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        _config(*overrides)


def test_split_placement_accepts_the_hf_rollout_and_vllm_engines_of_a_full_or_lora_actor():
    assert _config("actor_rollout_ref.rollout.n_gpus_per_node=2").actor_rollout_ref.rollout.n_gpus_per_node == 2
    for engine in ("hf", "vllm"):
        lora = _config("actor_rollout_ref.rollout.n_gpus_per_node=2", "actor_rollout_ref.model.lora_rank=8",
                       f"actor_rollout_ref.rollout.name={engine}")
        assert lora.actor_rollout_ref.model.lora_rank == 8
    assert _config().actor_rollout_ref.rollout.n_gpus_per_node == 0
    # vLLM engines of TP 4 on 4 devices of their own, beside a trainer of 2 (which TP 4 does not divide)
    vllm = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n_gpus_per_node=4")
    with pytest.raises(ConfigError, match="divide the DP world size"):
        _config(*vllm[:-1])
    assert _config(*vllm).actor_rollout_ref.rollout.n_gpus_per_node == 4
    # one-step-off with vLLM: refused colocated (the engine sleeps while the actor trains), accepted on its own devices
    off = ("actor_rollout_ref.rollout.name=vllm", "async_training.staleness_threshold=1",
           "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token")
    with pytest.raises(ConfigError, match="give it devices of its own"):
        _config(*off)
    assert _config(*off, "actor_rollout_ref.rollout.n_gpus_per_node=1").async_training.staleness_threshold == 1


def _assert_generates_as(standalone, reference, prompts, model_path: str, rollout_config) -> None:
    """The standalone rollout's greedy generation of ``prompts`` is, as version 1, what HF generate with the model
    ``reference`` gives (the tokenizer's EOS and pad for both)."""
    from transformers import AutoTokenizer

    from verl.workers.rollout.engine import POLICY_VERSION
    from verl.workers.rollout.hf_rollout import HFRollout

    after = standalone.engine.generate_sequences(prompts)
    assert after.meta_info[POLICY_VERSION] == 1
    assert after.batch["responses"].shape == (len(prompts), RESPONSE_LEN)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts.meta_info.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected = HFRollout(reference, rollout_config).generate_sequences(prompts)
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(after.batch[key], expected.batch[key]), key


@pytest.mark.slow  # 25-35 s each measured: 2 actor and 2-3 rollout processes
@pytest.mark.processes
@pytest.mark.parametrize("strategy, devices", [("fsdp2", 3), pytest.param("fsdp", 2, marks=pytest.mark.extended)])
def test_a_synced_rollout_group_generates_with_the_actors_updated_weights(tiny_model_path, tmp_path, ray_cluster,
                                                                          strategy, devices):
    from transformers import AutoModelForCausalLM

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.trainer_placement import StandaloneRollout
    from verl.workers.fsdp_workers import ActorRolloutRefWorker
    from verl.workers.rollout.engine import POLICY_VERSION

    config = actor_rollout_ref_config(tiny_model_path, strategy=strategy, ppo_mini_batch_size=4,
                                      ppo_micro_batch_size_per_gpu=2)
    config.actor.optim.lr = 1e-2  # an update that moves every weight visibly
    pool = RayResourcePool([2], use_gpu=False)
    actor = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, role="actor_rollout"))
    standalone = None
    try:
        actor.init_model()
        standalone = StandaloneRollout(config, devices, use_gpu=False)
        rows = 2 * devices  # a multiple of either group's ranks
        prompts = make_prompts(rows, vocab_size=1024, seed=3)
        prompts.meta_info["do_sample"] = False
        before = standalone.engine.generate_sequences(prompts)
        assert before.meta_info[POLICY_VERSION] == 0

        actor.update_actor(make_ppo_batch(8, vocab_size=1024, seed=5))
        metrics = standalone.sync(actor)
        assert metrics["rollout/standalone_policy_version"] == 1.0 and metrics["timing_s/weight_sync"] > 0
        actor.save_checkpoint(str(tmp_path / "v1"), save_hf_model=True)
        updated = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()

        # the rollout group's weights, gathered back from its own shards, are the actor's export bit for bit
        weights, version, _ = standalone.worker_group.export_rollout_weights()[0]
        import ray

        installed = ray.get(weights).model
        assert version == 1
        expected = dict(updated.named_parameters())
        assert set(installed) == set(expected)
        for name, tensor in installed.items():
            assert torch.equal(tensor, expected[name].detach()), name
        original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        assert not torch.equal(installed["model.embed_tokens.weight"], original.model.embed_tokens.weight)

        # and it generates what a plain HF model with those weights generates, as version 1
        _assert_generates_as(standalone, updated, prompts, tiny_model_path, config.rollout)
    finally:
        if standalone is not None:
            standalone.shutdown()
        actor.shutdown()
        pool.remove()


def test_full_weights_exported_from_one_model_install_into_another_and_wrong_ones_are_refused(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from verl.workers.rollout.standalone_weights import export_full_weights, install_full_weights

    source = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for param in source.parameters():
            param.add_(0.5)
    full, stats = export_full_weights(source, torch.float32, bucket_bytes=2**20)
    target = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert install_full_weights(target, full) == len(list(target.parameters())) == stats.tensors
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name
    renamed = {("x" if k == "model.norm.weight" else k): v for k, v in full.items()}
    with pytest.raises(ValueError, match=r"not this model's: missing \['model.norm.weight'\], unknown \['x'\]"):
        install_full_weights(target, renamed)
    bad = dict(full)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        install_full_weights(target, bad)


def _lora_model(path: str, settings):
    from transformers import AutoModelForCausalLM

    from verl.utils.lora import apply_lora

    return apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), settings, "causal_lm", "test")


def _assert_same_parameters(model: torch.nn.Module, expected: torch.nn.Module) -> None:
    want = dict(expected.named_parameters())
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def test_a_lora_actor_exports_its_base_once_then_its_adapter_alone_or_merged_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from verl.utils.lora import LoraSettings
    from verl.workers.rollout.standalone_weights import (RolloutWeights, export_rollout_weights,
                                                         install_rollout_weights)

    settings = LoraSettings(rank=4, alpha=8)
    source, target = _lora_model(tiny_model_path, settings), _lora_model(tiny_model_path, settings)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in source.parameters():  # every weight differs from the target's, base and adapter
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
    adapter = [name for name, _ in source.named_parameters() if ".lora_" in name]
    total = len(list(source.parameters()))
    first, stats = export_rollout_weights(source, torch.float32, 2**20, settings, send_base=True)
    assert len(first.adapter) == len(adapter) and len(first.model) == total - len(adapter) == stats.tensors - len(adapter)
    assert first.adapter_config["r"] == 4 and first.adapter_config["peft_type"] == "LORA"
    assert install_rollout_weights(target, first) == total
    _assert_same_parameters(target, source)

    with torch.no_grad():
        for name, param in source.named_parameters():
            if ".lora_" in name:
                param.add_(1.0)
    later, stats = export_rollout_weights(source, torch.float32, 2**20, settings, send_base=False)
    assert later.model is None and stats.tensors == len(later.adapter) == len(adapter)
    assert install_rollout_weights(target, later) == len(adapter)
    _assert_same_parameters(target, source)

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with pytest.raises(ValueError, match="carries no LoRA adapter"):
        install_rollout_weights(plain, later)
    with pytest.raises(ValueError, match="the payload has none"):
        install_rollout_weights(target, RolloutWeights(model=dict(plain.named_parameters())))

    # model.lora.merge: a plain model given W + alpha / r * B @ A is PEFT's merged model
    merge = LoraSettings(rank=4, alpha=8, merge=True)
    merged, _ = export_rollout_weights(source, torch.float32, 2**20, merge, send_base=False)
    assert merged.adapter is None and install_rollout_weights(plain, merged) == len(list(plain.parameters()))
    reference = source.merge_and_unload()
    for name, tensor in plain.named_parameters():
        torch.testing.assert_close(tensor, dict(reference.named_parameters())[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 30 s measured: 2 actor and 2 rollout processes
@pytest.mark.processes
def test_a_lora_actors_rollout_group_gets_the_adapter_alone_and_generates_as_base_plus_adapter(
        tiny_model_path, tmp_path, ray_cluster):
    import ray
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.trainer_placement import StandaloneRollout
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    config = actor_rollout_ref_config(tiny_model_path, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    config.actor.optim.lr = 5e-2
    config.model = OmegaConf.merge(config.model, {"lora_rank": 8, "lora_alpha": 16})
    pool = RayResourcePool([2], use_gpu=False)
    actor = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, role="actor"))
    standalone = None
    try:
        actor.init_model()
        standalone = StandaloneRollout(config, 2, use_gpu=False)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        adapter_tensors = 2 * 7 * base.config.num_hidden_layers  # A and B of the 7 linear layers of each layer
        first = standalone.sync(actor)
        assert first["rollout/weight_sync_tensors"] == len(list(base.parameters())) + adapter_tensors

        actor.update_actor(make_ppo_batch(8, vocab_size=1024, seed=5))
        later = standalone.sync(actor)  # the adapter alone: the rollout keeps the base it got
        assert later["rollout/weight_sync_tensors"] == adapter_tensors
        assert later["rollout/standalone_policy_version"] == 1.0
        actor.save_checkpoint(str(tmp_path / "v1"))
        saved = load_file(tmp_path / "v1" / "adapter_model.safetensors")

        # the rollout group's own weights, gathered back: the untouched base and the actor's trained adapter
        installed = ray.get(standalone.worker_group.export_rollout_weights()[0][0])
        assert set(installed.adapter) == set(saved)
        for name, tensor in installed.adapter.items():
            assert torch.equal(tensor, saved[name]), name
        assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in saved.items() if "lora_B" in n)
        originals = dict(base.named_parameters())
        assert set(installed.model) == set(originals)
        for name, tensor in installed.model.items():
            assert torch.equal(tensor, originals[name].detach()), name

        # and it generates what PEFT's base + the saved adapter generates, as version 1
        prompts = make_prompts(4, vocab_size=1024, seed=3)
        prompts.meta_info["do_sample"] = False
        reference = PeftModel.from_pretrained(base, tmp_path / "v1").eval()
        _assert_generates_as(standalone, reference, prompts, tiny_model_path, config.rollout)
    finally:
        if standalone is not None:
            standalone.shutdown()
        actor.shutdown()
        pool.remove()
