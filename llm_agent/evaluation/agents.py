"""The agents an evaluation can run, each behind the actor worker group's interface (`generate_sequences(DataProto)`
and `world_size`), so the rollout loop drives them exactly as it drives the trainer's policy.

- `HFRolloutAgent`: a Hugging Face model directory (or a training checkpoint's `actor/` export) generating through
  `verl.workers.rollout.hf_rollout.HFRollout`, the trainer's own rollout code (single process, GPU when present).
- `OpenAIChatAgent`: any OpenAI-compatible chat-completions endpoint serving the agent (a hosted baseline). Each
  left-padded context is decoded, split into chat messages with the tokenizer's chat template, sent to the
  endpoint, and the answer is tokenized with the same tokenizer (plus EOS unless it stopped on the length limit).
  The rollout loop's token budgets therefore count this tokenizer's tokens, not the hosted model's.
- `scripted:<quality>`: the scripted stand-in agent (`llm_agent.stand_ins`), a reference point for tests and demos.

`build_agent(spec, ...)` picks one from a command-line spec: a directory, an `http(s)://` URL or `scripted:...`.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from llm_agent.scenario import Scenario
from llm_agent.stand_ins.scripted_policy import QUALITIES, ChatLayout, ScriptedPolicyWorkerGroup
from verl.protocol import DataProto
from verl.utils.checkpoint import find_latest_checkpoint
from verl.utils.dataset import load_tokenizer
from verl.workers.batching import select_batch
from verl.workers.rollout.hf_rollout import PROMPT_KEYS, HFRollout, generation_tensors

logger = logging.getLogger(__name__)

__all__ = ["AgentSpec", "HFRolloutAgent", "OpenAIChatAgent", "build_agent", "resolve_model_dir"]

SCRIPTED_PREFIX = "scripted:"


def resolve_model_dir(path: str | Path) -> Path:
    """The HF model directory behind `path`: itself, its `actor/` export (a `global_step_N` checkpoint), or the
    latest complete checkpoint's `actor/` (a checkpoint root); ValueError naming the path otherwise."""
    root = Path(path)
    if (root / "config.json").is_file():
        return root
    if (root / "actor" / "config.json").is_file():
        return root / "actor"
    latest = find_latest_checkpoint(root) if root.is_dir() else None
    if latest is not None and (latest / "actor" / "config.json").is_file():
        return latest / "actor"
    raise ValueError(f"{path}: not a model directory (no config.json), a checkpoint with actor/config.json, or a "
                     "checkpoint root with a complete global_step_N")


class HFRolloutAgent:
    """A local model generating through the trainer's `HFRollout` (greedy unless the batch's meta_info samples)."""

    world_size = 1

    def __init__(self, model_dir: str | Path, micro_batch_size: int | None = None, device: str | None = None):
        from transformers import AutoModelForCausalLM

        self.model_dir = resolve_model_dir(model_dir)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        self.tokenizer = load_tokenizer(str(self.model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype).to(self.device)
        self.rollout = HFRollout(model, OmegaConf.create({"micro_batch_size_per_gpu": micro_batch_size,
                                                          "do_sample": False}))
        logger.info("agent %s on %s (%s)", self.model_dir, self.device, dtype)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """HFRollout's `generate_sequences` on this process's model."""
        return self.rollout.generate_sequences(prompts)


class OpenAIChatAgent:
    """Worker-group adapter over an OpenAI-compatible `/v1/chat/completions` endpoint (see the module docstring).

    Rows of one call are sent concurrently (`concurrency` requests at a time); a request that fails
    `max_attempts` times (connection error, timeout, HTTP 5xx/429) raises RuntimeError naming the endpoint, which
    stops the evaluation (finished chunks stay on disk and a rerun resumes).
    """

    world_size = 1

    def __init__(self, base_url: str, tokenizer: Any, model: str | None = None, api_key: str | None = None,
                 concurrency: int = 16, timeout_s: float = 120.0, max_attempts: int = 3) -> None:
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.layout = ChatLayout(tokenizer)
        probe = tokenizer.apply_chat_template([{"role": "system", "content": "@@S0@@"},
                                               {"role": "user", "content": "@@U1@@"}], tokenize=False,
                                              add_generation_prompt=True)
        self._system_prefix = probe[:probe.find("@@S0@@")]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self.concurrency, self.max_attempts = max(1, concurrency), max(1, max_attempts)
        self.model = model or self._served_model()
        self.requests = 0

    def _served_model(self) -> str:
        """The first model id of GET /v1/models (used when no model name was given)."""
        try:
            response = self.http.get("/v1/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise RuntimeError(f"agent endpoint {self.base_url}: cannot list its models ({exc}); pass the model "
                               "name explicitly") from None

    def messages(self, text: str) -> list[dict[str, str]]:
        """The chat messages of one decoded agent-side context (system prompt, then user/assistant turns)."""
        start = text.find(self._system_prefix)
        end = text.find(self.layout.system_to_user)
        if start < 0 or end < start:
            raise ValueError("the decoded context does not start with a system message of the chat template")
        system = text[start + len(self._system_prefix):end]
        return [{"role": "system", "content": system},
                *({"role": role, "content": content} for role, content in self.layout.split(text))]

    def _complete(self, messages: list[dict[str, str]], settings: dict[str, Any]) -> tuple[str, str]:
        """(text, finish_reason) of one chat completion, retried on transport errors, 429 and 5xx."""
        body = {"model": self.model, "messages": messages, **settings}
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = self.http.post("/v1/chat/completions", json=body)
                if response.status_code == 429 or response.status_code >= 500:
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    response.raise_for_status()
                    choice = response.json()["choices"][0]
                    return choice["message"]["content"] or "", choice.get("finish_reason") or "stop"
            except httpx.HTTPStatusError as exc:  # 4xx: the request itself is wrong, retrying cannot help
                raise RuntimeError(f"agent endpoint {self.base_url} rejected a request: {exc.response.status_code} "
                                   f"{exc.response.text[:300]}") from None
            except (httpx.TransportError, KeyError, IndexError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(min(2.0, 0.2 * 2 ** attempt))
        raise RuntimeError(f"agent endpoint {self.base_url}: {self.max_attempts} attempts failed, last: {last}")

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
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(texts))) as pool:
            answers = list(pool.map(lambda m: self._complete(m, settings), conversations))
        self.requests += len(answers)
        rows = []
        for text, finish in answers:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            rows.append(ids[:length] if finish == "length" or len(ids) >= length else ids + [eos_id])
        responses = torch.tensor([ids + [pad] * (length - len(ids)) for ids in rows], dtype=input_ids.dtype)
        tensors = generation_tensors(input_ids, mask, batch["position_ids"], responses, eos, pad)
        return DataProto(batch=TensorDict(tensors, batch_size=[input_ids.size(0)]))

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


def build_agent(spec: str, scenario: Scenario, tokenizer_path: str | None = None, agent_model: str | None = None,
                api_key: str | None = None, concurrency: int = 16, micro_batch_size: int | None = None
                ) -> tuple[Any, Any]:
    """(worker-group-like agent, its tokenizer) for a spec: a model/checkpoint directory, an `http(s)://` endpoint
    (needs `tokenizer_path`) or `scripted:<quality>` (needs `tokenizer_path`)."""
    if spec.startswith(("http://", "https://")) or spec.startswith(SCRIPTED_PREFIX):
        if not tokenizer_path:
            raise ValueError(f"agent {spec!r} needs --tokenizer DIR (the tokenizer whose chat template carries the "
                             "dialogue between the loop and the agent)")
        tokenizer = load_tokenizer(tokenizer_path)
        if spec.startswith(SCRIPTED_PREFIX):
            quality = spec[len(SCRIPTED_PREFIX):]
            if quality not in QUALITIES:
                raise ValueError(f"agent {spec!r}: the scripted quality must be one of {QUALITIES}")
            return ScriptedPolicyWorkerGroup(tokenizer, scenario, world_size=1, quality=quality), tokenizer
        return OpenAIChatAgent(spec, tokenizer, model=agent_model, api_key=api_key,
                               concurrency=concurrency), tokenizer
    agent = HFRolloutAgent(spec, micro_batch_size=micro_batch_size)
    return agent, agent.tokenizer
