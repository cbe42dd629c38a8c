"""A real 2-rank actor_rollout worker group generating with vLLM (FSDP2 on gloo, one engine per TP group), for
the vLLM tests, with vLLM's CPU shared-memory segments cleaned up around it and, at TP 2, this machine's TP engine
lock held (tests/helpers/machine_lock.py)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ray
from omegaconf import OmegaConf

from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.fsdp_workers import ActorRolloutRefWorker
from verl.workers.rollout.vllm_rollout.cpu_shm import remove_stale_segments

from tests.helpers.machine_lock import cpu_tp_engine
from tests.helpers.ppo_batch_helpers import actor_rollout_ref_config

ENGINE = {"name": "vllm", "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.5, "max_num_seqs": 16,
          "max_num_batched_tokens": 256, "max_model_len": None, "enforce_eager": True, "enable_prefix_caching": True,
          "dtype": "auto", "seed": 0, "free_cache_engine": True, "calculate_log_probs": True}


@contextlib.contextmanager
def vllm_worker_group(model_path: str, tp: int, name: str, actor: dict[str, Any],
                      engine: dict[str, Any] | None = None) -> Iterator[RayWorkerGroup]:
    """Ray up, a 2-rank actor_rollout group with vLLM engines of TP `tp` (`actor`: actor_rollout_ref_config
    keywords; `engine`: rollout keys over ENGINE), initialised; everything torn down after."""
    with cpu_tp_engine(tp):
        remove_stale_segments()
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        config = actor_rollout_ref_config(model_path, **actor)
        config.rollout = OmegaConf.merge(config.rollout, ENGINE, engine or {}, {"tensor_model_parallel_size": tp})
        pool = RayResourcePool([2], use_gpu=False, name_prefix=f"{name}_pool")
        try:
            workers = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, role="actor_rollout"),
                                     name_prefix=name)
            try:
                workers.init_model()
                yield workers
            finally:
                workers.shutdown()
        finally:
            pool.remove()
            ray.shutdown()
            remove_stale_segments()
