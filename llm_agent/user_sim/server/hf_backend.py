"""Transformers backend of the simulator server: a local causal LM completes the rendered chat.

Generation runs in the server's worker thread behind a lock (one `generate` at a time; the model is not
re-entrant). `n`, `temperature` (below 1e-5 = greedy), `top_p`, `seed` and `max_tokens` are honoured; a seeded request
is reproducible because sampling runs under a forked, seeded torch RNG.
"""
from __future__ import annotations

import logging
import random
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_agent.user_sim.server.backend import BackendInputError, BackendResult, Completion, SamplingParams
from verl.utils.text_tokens import tokenize_chat

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 512
GREEDY_BELOW_TEMPERATURE = 1e-5  # logits / 1e-300 overflow to inf (torch.multinomial fails); treat as greedy


class HFChatBackend:
    """Serve chat completions from a local transformers model directory (CPU or one CUDA device)."""

    def __init__(self, model_path: str | Path, *, seed: int = 0, device: str | None = None,
                 dtype: torch.dtype | None = None, default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> None:
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(f"--model {model_path}: not a local model directory")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tokenizer.chat_template is None:
            raise ValueError(f"{path}: the tokenizer has no chat template; the hf backend needs one")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.default_max_tokens = default_max_tokens
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        logger.info("hf backend: %s on %s (%s), context %d", path, self.device, dtype, self.max_context)

    def _prompt_ids(self, messages: list[dict[str, str]]) -> torch.Tensor:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        try:  # the one rule for outside text: a message's control-token text never becomes a control token
            encoded = tokenize_chat(self.tokenizer, messages, [(text, 0)], generation_prompt=True)
        except ValueError as exc:
            raise BackendInputError(str(exc)) from None
        ids = torch.tensor([encoded[0]], dtype=torch.long)
        if ids.shape[1] >= self.max_context:
            raise BackendInputError(
                f"the prompt has {ids.shape[1]} tokens; the model's context is {self.max_context} tokens")
        return ids.to(self.device)

    def complete(self, messages: list[dict[str, str]], params: SamplingParams) -> BackendResult:
        """Generate `params.n` completions of `messages` with the model's chat template."""
        prompt = self._prompt_ids(messages)
        budget = self.max_context - prompt.shape[1]
        max_new = min(params.max_tokens or self.default_max_tokens, budget)
        greedy = params.temperature < GREEDY_BELOW_TEMPERATURE
        # Greedy decoding is deterministic: generate once and repeat it (generate() refuses n > 1 without sampling).
        kwargs = dict(max_new_tokens=max_new, num_return_sequences=1 if greedy else params.n, do_sample=not greedy,
                      pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                      attention_mask=torch.ones_like(prompt))
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        with self._lock:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.inference_mode():
                torch.manual_seed(seed)
                out = self.model.generate(prompt, **kwargs)
        choices = [self._decode(row) for row in out[:, prompt.shape[1]:]]
        return BackendResult(choices=choices * params.n if greedy else choices, prompt_tokens=int(prompt.shape[1]))

    def _decode(self, generated: torch.Tensor) -> Completion:
        ids = generated.tolist()
        eos = self.tokenizer.eos_token_id
        if eos in ids:
            ids = ids[: ids.index(eos)]
            reason, count = "stop", len(ids) + 1
        else:
            pad = self.tokenizer.pad_token_id
            while ids and ids[-1] == pad:
                ids.pop()
            reason, count = "length", len(ids)
        return Completion(self.tokenizer.decode(ids, skip_special_tokens=True), reason, count)
