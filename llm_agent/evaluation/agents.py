"""The agents an evaluation can run, each a `verl.workers.rollout.engine.RolloutEngine` (`generate_sequences(DataProto)`
and `world_size`), so the rollout loop drives them exactly as it drives the trainer's policy.

- a Hugging Face model directory or a training checkpoint (`llm_agent.evaluation.local_agents`): generating through
  the trainer's own rollout engines, `HFRollout` or `vLLMRollout` (`engine`: auto = vLLM when it is installed).
- `OpenAIChatAgent`: any OpenAI-compatible chat-completions endpoint serving the agent (a hosted baseline). Each
  left-padded context is decoded, split into chat messages with the tokenizer's chat template
  (`llm_agent.rollout.chat_layout.ChatLayout`), sent to the endpoint, and the answer is tokenized with the same
  tokenizer (plus EOS unless it stopped on the length limit). The rollout loop's token budgets therefore count
  this tokenizer's tokens, not the hosted model's. With a text listener (`stream_text`), a one-row batch is
  requested streamed and its text handed on as it comes; the turn is the same as without it.
- `scripted:<quality>`: the scripted stand-in agent (`llm_agent.stand_ins`), a reference point for tests and demos.

`build_agent(spec, ...)` picks one from a command-line spec: a directory, an `http(s)://` URL or `scripted:...`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from tensordict import TensorDict

from llm_agent.evaluation.local_agents import HFRolloutAgent, VLLMRolloutAgent, pick_engine
from llm_agent.openai_endpoint import EndpointError, OpenAIEndpoint
from llm_agent.rollout.chat_layout import ChatLayout
from llm_agent.scenario import Scenario
from verl.protocol import DataProto
from verl.utils.dataset import load_tokenizer
from verl.utils.text_tokens import encode_text
from verl.workers.batching import select_batch
from verl.workers.rollout.engine import RolloutEngine, TextStreaming
from verl.workers.rollout.hf_rollout import PROMPT_KEYS, generation_tensors

logger = logging.getLogger(__name__)

__all__ = ["AgentSpec", "LocalEngineOptions", "OpenAIChatAgent", "build_agent"]

SCRIPTED_PREFIX = "scripted:"


class OpenAIChatAgent(RolloutEngine, TextStreaming):
    """A rollout engine over an OpenAI-compatible `/v1/chat/completions` endpoint (see the module docstring; its
    policy version is 0: the evaluation never changes it).

    Rows of one call are sent concurrently (`concurrency` requests at a time); a request that fails
    `max_attempts` times (connection error, timeout, HTTP 5xx/429) raises RuntimeError naming the endpoint, which
    stops the evaluation (finished chunks stay on disk and a rerun resumes).
    """

    def __init__(self, base_url: str, tokenizer: Any, model: str | None = None, api_key: str | None = None,
                 concurrency: int = 16, timeout_s: float = 120.0, max_attempts: int = 3) -> None:
        self.http = OpenAIEndpoint(base_url, api_key=api_key, timeout_s=timeout_s)
        self.base_url = self.http.base
        self.tokenizer = tokenizer
        self.layout = ChatLayout(tokenizer)
        self.concurrency, self.max_attempts = max(1, concurrency), max(1, max_attempts)
        self.model = model or self._served_model()
        self.requests = 0
        self.listener: Callable[[str | None], None] | None = None

    def _served_model(self) -> str:
        """The first model id of GET /v1/models (used when no model name was given)."""
        try:
            return self.http.served_models()[0]
        except EndpointError as exc:
            raise RuntimeError(f"agent endpoint: cannot list its models ({exc}); pass the model name explicitly"
                               ) from None

    def messages(self, text: str) -> list[dict[str, str]]:
        """The chat messages of one decoded agent-side context (system prompt, then user/assistant turns)."""
        return self.layout.messages(text)

    def stream_text(self, listener: Callable[[str | None], None] | None) -> None:
        """Stream a one-row batch's answer, handing its text to `listener` in pieces (None after each attempt);
        None: stop."""
        self.listener = listener

    def _complete(self, messages: list[dict[str, str]], settings: dict[str, Any],
                  listener: Callable[[str | None], None] | None = None) -> tuple[str, str]:
        """(text, finish_reason) of one chat completion, retried on timeouts, connection errors, 408/429/5xx and
        replies that are not a chat completion; each attempt has a total deadline (`timeout_s`). With `listener`,
        each attempt is streamed to it, None after it."""
        body = {"model": self.model, "messages": messages, **settings}
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self.http.chat(body) if listener is None else self.http.chat_stream(body, listener)
            except EndpointError as exc:
                if exc.kind == "rejected":  # 4xx: the request itself is wrong, retrying cannot help
                    raise RuntimeError(f"agent endpoint rejected a request: {exc}") from None
                last = f"{exc.kind}: {exc}"
            finally:
                if listener is not None:
                    listener(None)
            if attempt < self.max_attempts:
                time.sleep(min(2.0, 0.2 * 2 ** attempt))
        raise RuntimeError(f"agent endpoint: {self.max_attempts} attempts failed, last: {last}")

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One endpoint answer per left-padded row, with HFRollout's output keys and shapes."""
        batch = select_batch(prompts, PROMPT_KEYS, "generate_sequences")
        meta = prompts.meta_info
        length, eos, pad = int(meta["response_length"]), meta["eos_token_id"], int(meta["pad_token_id"])
        eos_id = eos[0] if isinstance(eos, (list, tuple)) else int(eos)
        settings: dict[str, Any] = {"max_tokens": length, "temperature": 0.0}
        if meta.get("do_sample"):
            settings.update(temperature=float(meta.get("temperature", 1.0)), top_p=float(meta.get("top_p", 1.0)))
        input_ids, mask = batch["input_ids"], batch["attention_mask"]
        texts = [self.tokenizer.decode(input_ids[i][mask[i].bool()].tolist(), skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False) for i in range(input_ids.size(0))]
        conversations = []
        for i, text in enumerate(texts):
            try:
                conversations.append(self.messages(text))
            except ValueError as exc:
                raise ValueError(f"generate_sequences: row {i}: {exc}") from None
        if self.listener is not None and len(conversations) == 1:
            answers = [self._complete(conversations[0], settings, self.listener)]
        else:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(texts))) as pool:
                answers = list(pool.map(lambda m: self._complete(m, settings), conversations))
        self.requests += len(answers)
        rows = []
        for text, finish in answers:
            ids = encode_text(self.tokenizer, text)  # the endpoint's text: control-token text stays text
            rows.append(ids[:length] if finish == "length" or len(ids) >= length else ids + [eos_id])
        responses = torch.tensor([ids + [pad] * (length - len(ids)) for ids in rows], dtype=input_ids.dtype)
        tensors = generation_tensors(input_ids, mask, batch["position_ids"], responses, eos, pad)
        return self.versioned(DataProto(batch=TensorDict(tensors, batch_size=[input_ids.size(0)])))

    def close(self) -> None:
        """Close the HTTP client."""
        self.http.close()


@dataclass
class AgentSpec:
    """A named agent of the command line: `NAME=SPEC` or just `SPEC` (the name is then derived from it)."""

    name: str
    spec: str

    @classmethod
    def parse(cls, text: str) -> "AgentSpec":
        """`name=spec` or `spec`; the default name is the directory's name (its parent's for `actor/` and
        `global_step_N`), the URL's host and port, or `scripted-<quality>`."""
        name, sep, spec = text.partition("=")
        if sep and name and "/" not in name and ":" not in name:
            return cls(name, spec)
        spec = text
        if spec.startswith(SCRIPTED_PREFIX):
            return cls(f"scripted-{spec[len(SCRIPTED_PREFIX):]}", spec)
        if spec.startswith(("http://", "https://")):
            return cls(httpx.URL(spec).netloc.decode().replace(":", "_"), spec)
        parts = [p for p in Path(spec).resolve().parts if p != "actor"]
        tail = parts[-1] if parts else "agent"
        if tail.startswith("global_step_") and len(parts) > 1:
            tail = f"{parts[-2]}_{tail[len('global_step_'):]}"
        return cls(tail, spec)

    @property
    def is_local(self) -> bool:
        """True for a model directory or checkpoint (not an endpoint or the scripted agent)."""
        return not self.spec.startswith(("http://", "https://", SCRIPTED_PREFIX))

    def describe(self, engine: str) -> str:
        """The spec as results files record it; a local agent's with the engine that generated."""
        return f"{self.spec} ({engine})" if self.is_local else self.spec


@dataclass
class LocalEngineOptions:
    """How a model directory or checkpoint agent generates: `engine` (auto | hf | vllm; auto = vllm when it is
    installed), HF's rows per `generate` call, the vLLM engine's context limit (prompt + dialogue tokens) and
    GPU memory share, and whether a checkpoint without a manifest may be opened (--trust-checkpoint)."""

    engine: str = "auto"
    micro_batch_size: int | None = None
    max_model_len: int = 4096 + 1024
    gpu_memory_utilization: float = 0.8
    trust_checkpoint: bool = False


def build_agent(spec: str, scenario: Scenario, tokenizer_path: str | None = None, agent_model: str | None = None,
                api_key: str | None = None, concurrency: int = 16, local: LocalEngineOptions | None = None
                ) -> tuple[RolloutEngine, Any]:
    """(the agent's rollout engine, its tokenizer) for a spec: a model/checkpoint directory (generating as `local`
    says), an `http(s)://` endpoint (needs `tokenizer_path`) or `scripted:<quality>` (needs `tokenizer_path`)."""
    if spec.startswith(("http://", "https://")) or spec.startswith(SCRIPTED_PREFIX):
        if not tokenizer_path:
            raise ValueError(f"agent {spec!r} needs --tokenizer DIR (the tokenizer whose chat template carries the "
                             "dialogue between the loop and the agent)")
        tokenizer = load_tokenizer(tokenizer_path)
        if spec.startswith(SCRIPTED_PREFIX):
            from llm_agent.stand_ins.scripted_policy import QUALITIES, ScriptedPolicyWorkerGroup

            quality = spec[len(SCRIPTED_PREFIX):]
            if quality not in QUALITIES:
                raise ValueError(f"agent {spec!r}: the scripted quality must be one of {QUALITIES}")
            return ScriptedPolicyWorkerGroup(tokenizer, scenario, world_size=1, quality=quality), tokenizer
        return OpenAIChatAgent(spec, tokenizer, model=agent_model, api_key=api_key,
                               concurrency=concurrency), tokenizer
    local = local or LocalEngineOptions()
    if pick_engine(local.engine) == "vllm":
        agent: RolloutEngine = VLLMRolloutAgent(spec, max_model_len=local.max_model_len,
                                                gpu_memory_utilization=local.gpu_memory_utilization,
                                                trust_unverified=local.trust_checkpoint)
    else:
        agent = HFRolloutAgent(spec, micro_batch_size=local.micro_batch_size, trust_unverified=local.trust_checkpoint)
    return agent, agent.tokenizer
