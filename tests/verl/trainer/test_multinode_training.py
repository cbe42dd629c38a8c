"""trainer.nnodes=2 on an existing Ray cluster: `run_ppo` joins the cluster named by RAY_ADDRESS (as after
`ray start --head` on one machine and `ray start --address` on the others), places one worker per node and
trains, validates and checkpoints. The cluster is simulated on this machine with Ray's own test utility: a head
with no CPUs (so no worker can land beside the driver) and two 1-CPU nodes."""
from __future__ import annotations

import json

import pytest
import ray
from ray.cluster_utils import Cluster

pytestmark = pytest.mark.slow


@pytest.fixture()
def two_node_cluster(monkeypatch):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


@pytest.mark.extended  # 40 s measured: make test-extended (CI), out of make test's 20 minutes
def test_two_node_training_joins_the_running_cluster(tiny_model_path, tmp_path, two_node_cluster):
    from verl.tasks.repeat_letter import make_dataset
    from verl.trainer.config_schema import compose_config
    from verl.trainer.main_ppo import run_ppo

    make_dataset(tmp_path / "data", train_size=16, val_size=4, seed=0)
    last = run_ppo(compose_config([
        f"actor_rollout_ref.model.path={tiny_model_path}", f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'data' / 'val.parquet'}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "data.max_response_length=4", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1", "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=jsonl", "trainer.save_freq=1",
        "trainer.test_freq=1", "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'logs'}"]))
    assert "actor/pg_loss" in last and "val/test_score/repeat_letter" in last
    steps = [json.loads(line)["step"] for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
    shards = sorted(p.name for p in (tmp_path / "ckpt" / "global_step_1" / "actor").glob("extra_state_rank_*.pt"))
    assert shards == ["extra_state_rank_0.pt", "extra_state_rank_1.pt"]  # one FSDP rank on each node
    assert not ray.is_initialized(), "run_ppo disconnects from a cluster it joined (and leaves the cluster up)"
    assert len([n for n in two_node_cluster.list_all_nodes()]) == 3
