"""Split placement (``actor_rollout_ref.rollout.n_gpus_per_node`` > 0): the config's refusals, and a rollout group of
its own that, after a sync, holds exactly the actor's updated weights (compared with the actor's HF export, read by
transformers) and generates what a plain HF model with those weights generates, reporting the installed version."""
from __future__ import annotations

import pytest
import torch

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
    (["actor_rollout_ref.rollout.n_gpus_per_node=2", "actor_rollout_ref.model.lora_rank=8"],
     "only the adapter trains"),
])
def test_split_placement_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        _config(*overrides)


def test_split_placement_accepts_the_hf_rollout_and_vllm_engines_of_a_full_actor():
    assert _config("actor_rollout_ref.rollout.n_gpus_per_node=2").actor_rollout_ref.rollout.n_gpus_per_node == 2
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


@pytest.mark.slow  # 25-35 s each measured: 2 actor and 2-3 rollout processes
@pytest.mark.processes
@pytest.mark.parametrize("strategy, devices", [("fsdp2", 3), pytest.param("fsdp", 2, marks=pytest.mark.extended)])
def test_a_synced_rollout_group_generates_with_the_actors_updated_weights(tiny_model_path, tmp_path, ray_cluster,
                                                                          strategy, devices):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.trainer_placement import StandaloneRollout
    from verl.workers.fsdp_workers import ActorRolloutRefWorker
    from verl.workers.rollout.hf_rollout import HFRollout
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

        installed = ray.get(weights)
        assert version == 1
        expected = dict(updated.named_parameters())
        assert set(installed) == set(expected)
        for name, tensor in installed.items():
            assert torch.equal(tensor, expected[name].detach()), name
        original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        assert not torch.equal(installed["model.embed_tokens.weight"], original.model.embed_tokens.weight)

        # and it generates what a plain HF model with those weights generates, as version 1
        after = standalone.engine.generate_sequences(prompts)
        assert after.meta_info[POLICY_VERSION] == 1
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
        prompts.meta_info.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        reference = HFRollout(updated, config.rollout).generate_sequences(prompts)
        assert after.batch["responses"].shape == (rows, RESPONSE_LEN)
        for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
            assert torch.equal(after.batch[key], reference.batch[key]), key
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
