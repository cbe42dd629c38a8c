"""What the profile writer reads: sampling weights from a file, and answers from an OpenAI-compatible endpoint.

`load_weights(path)` accepts a mistakes analysis JSON (`for_evaluation/analyze_mistakes.py`: a split's
`recommended_weights.weights`), a checkpoint's `trainer_state.json` or its `global_step_N` directory (the state
controller's weights at that step), or a plain `{group: {label: weight}}` mapping. `ChatEndpoint.complete`
sends one chat-completions request and returns the text or raises
`llm_agent.openai_endpoint.EndpointError`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llm_agent.openai_endpoint import OpenAIEndpoint
from verl.utils.untrusted import load_json

__all__ = ["ChatEndpoint", "load_weights"]

MAX_WEIGHTS_FILE_BYTES = 256 << 20  # an analysis or trainer state is KBs to a few MB


def _controller_weights(controller: Any, where: str) -> dict[str, dict[str, float]]:
    if not isinstance(controller, Mapping) or not isinstance(controller.get("labels"), Mapping):
        raise ValueError(f"{where}: no state-controller weights (was the controller enabled?)")
    return {g: dict(zip(labels, controller["weights"][g])) for g, labels in controller["labels"].items()}


def load_weights(path: str | os.PathLike, split: str | None = None) -> dict[str, dict[str, float]]:
    """Sampling weights {group: {label: weight}} from one of the files of the module docstring; ValueError
    naming the file when it holds none (or, for an analysis with several splits and no `split`, which to use)."""
    path = Path(path)
    if path.is_dir():
        path = path / "trainer_state.json"
    try:
        data = load_json(path.read_bytes(), what=str(path), max_bytes=MAX_WEIGHTS_FILE_BYTES)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read sampling weights: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: must be a JSON object")
    if "splits" in data:  # a mistakes analysis
        splits = data["splits"]
        name = split or ("train" if "train" in splits else next(iter(splits)) if len(splits) == 1 else None)
        if name not in splits:
            raise ValueError(f"{path}: choose the analysis split to take weights from ({sorted(splits)})")
        return {g: dict(w) for g, w in splits[name]["recommended_weights"]["weights"].items()}
    if "rollout_loop" in data:  # a checkpoint's trainer_state.json
        return _controller_weights((data["rollout_loop"] or {}).get("controller"), str(path))
    if data and all(isinstance(v, Mapping) for v in data.values()):
        return {str(g): dict(w) for g, w in data.items()}
    raise ValueError(f"{path}: not a mistakes analysis, trainer_state.json or {{group: {{label: weight}}}} mapping")


class ChatEndpoint:
    """An OpenAI-compatible chat-completions endpoint (`base_url` with or without the /v1 suffix) asked with fixed
    sampling settings; `model` None asks for the first model it serves (`GET /v1/models`) at the first request.
    Each request has a total deadline of `timeout_s` and a size cap (`llm_agent.openai_endpoint`)."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None = None, timeout_s: float = 60.0,
                 temperature: float = 0.7, max_tokens: int = 256) -> None:
        self.http = OpenAIEndpoint(base_url, api_key=api_key, timeout_s=timeout_s)
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens

    def complete(self, messages: list[dict[str, str]], seed: int) -> str:
        """The first choice's text for `messages` (request seed `seed`); EndpointError on any failure."""
        if self.model is None:
            self.model = self.http.served_models()[0]
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "seed": seed}
        return self.http.chat(body)[0]

    def close(self) -> None:
        """Close the HTTP client."""
        self.http.close()
