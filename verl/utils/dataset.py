"""Parquet prompt dataset and a resumable, seeded prompt loader.

Each parquet row holds a prompt as a list of chat messages (``[{"role": ..., "content": ...}, ...]``) in the
``prompt_key`` column; the chat template (with the generation prompt) turns it into token ids, left-padded to
``max_prompt_length``. Every other column travels per row in ``non_tensor_batch`` (plus ``raw_prompt``, the
messages themselves), so plug-ins (rollout loop, reward) see them aligned with their rows.

:class:`PromptLoader` iterates batches of a seeded per-epoch permutation; its position (epoch, batch index) is
what ``state_dict`` saves, so a resumed run continues with exactly the batch an uninterrupted run would see next.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import pyarrow.parquet as pq
import torch

from verl.protocol import DataProto
from verl.utils.text_tokens import tokenize_chat

logger = logging.getLogger(__name__)

RAW_PROMPT_KEY = "raw_prompt"


def load_tokenizer(path: str, padding_side: str = "left"):
    """Load a local tokenizer with ``padding_side`` (not persisted by save_pretrained); pad falls back to eos."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side=padding_side)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token")
        logger.warning("tokenizer at %s has no pad token; using eos %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: the prompt must be a non-empty list of chat messages, got {messages!r:.200}")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {j} must be a mapping with 'role' and 'content', got {message!r:.200}")
    return [dict(m) for m in messages]


def left_pad(sequences: Sequence[Sequence[int]], length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-pad token-id lists to ``length``: input_ids, attention_mask and position_ids (0 on padding)."""
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, ids in enumerate(sequences):
        if len(ids) > length:
            raise ValueError(f"sequence {i} has {len(ids)} tokens > {length}")
        if ids:
            input_ids[i, length - len(ids):] = torch.as_tensor(list(ids), dtype=torch.long)
            attention_mask[i, length - len(ids):] = 1
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


class RLHFDataset:
    """Prompts from parquet files, tokenized with the chat template once at load time.

    Args:
        files: one parquet path or a list of them (rows are concatenated in order).
        tokenizer: a transformers tokenizer with a chat template and a pad token.
        prompt_key: the column holding the chat messages.
        max_prompt_length: prompts are left-padded to this many tokens.
        truncation: ``error`` (default) | ``left`` | ``right`` for prompts longer than max_prompt_length.
        filter_overlong_prompts: drop overlong prompts (the count is logged and kept in ``num_filtered``).
    """

    def __init__(self, files: Union[str, Sequence[str]], tokenizer, prompt_key: str = "prompt",
                 max_prompt_length: int = 1024, truncation: str = "error", filter_overlong_prompts: bool = False):
        if truncation not in ("error", "left", "right"):
            raise ValueError(f"truncation must be error | left | right, got {truncation!r}")
        self.files = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
        if not self.files:
            raise ValueError("RLHFDataset needs at least one parquet file")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.rows: list[dict[str, Any]] = []
        self.prompt_ids: list[list[int]] = []
        self.num_filtered = 0
        for path in self.files:
            self._load_file(path, truncation, filter_overlong_prompts)
        if not self.rows:
            raise ValueError(f"no prompts left in {self.files} (filtered {self.num_filtered} overlong prompts)")
        self.columns = sorted({k for row in self.rows for k in row if k != prompt_key})
        if self.num_filtered:
            logger.warning("filtered %d prompts longer than %d tokens from %s", self.num_filtered,
                           max_prompt_length, self.files)

    def _load_file(self, path: str, truncation: str, filter_overlong: bool) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"parquet file {path} does not exist")
        table = pq.read_table(path)
        if self.prompt_key not in table.column_names:
            raise ValueError(f"{path}: no column {self.prompt_key!r} (columns: {table.column_names}); "
                             f"set data.prompt_key")
        if RAW_PROMPT_KEY in table.column_names:
            raise ValueError(f"{path}: column name {RAW_PROMPT_KEY!r} is reserved for the chat messages")
        for i, row in enumerate(table.to_pylist()):
            where = f"{path} row {i}"
            messages = _check_messages(row[self.prompt_key], where)
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            try:  # message text by the one rule for outside text: control-token text stays text
                ids = tokenize_chat(self.tokenizer, messages, [(text, 0)], generation_prompt=True)[0]
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if len(ids) > self.max_prompt_length:
                if filter_overlong:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise ValueError(f"{where}: the prompt has {len(ids)} tokens > data.max_prompt_length="
                                     f"{self.max_prompt_length} (raise it, set data.truncation=left|right or "
                                     f"data.filter_overlong_prompts=true)")
                ids = ids[-self.max_prompt_length:] if truncation == "left" else ids[:self.max_prompt_length]
            row[self.prompt_key] = messages
            self.rows.append(row)
            self.prompt_ids.append(ids)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Row ``index``: its prompt token ids, messages and other columns."""
        row = dict(self.rows[index])
        row[RAW_PROMPT_KEY] = row.pop(self.prompt_key)
        row["prompt_ids"] = self.prompt_ids[index]
        return row

    def collate(self, indices: Sequence[int]) -> DataProto:
        """A DataProto of the given rows: left-padded prompt tensors plus every other column per row."""
        indices = [int(i) for i in indices]
        tensors = left_pad([self.prompt_ids[i] for i in indices], self.max_prompt_length,
                           self.tokenizer.pad_token_id)
        non_tensors: dict[str, np.ndarray] = {}
        for key in self.columns:
            values = np.empty(len(indices), dtype=object)
            for j, i in enumerate(indices):
                values[j] = self.rows[i].get(key)
            non_tensors[key] = values
        raw = np.empty(len(indices), dtype=object)
        for j, i in enumerate(indices):
            raw[j] = self.rows[i][self.prompt_key]
        non_tensors[RAW_PROMPT_KEY] = raw
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


class PromptLoader:
    """Seeded, resumable batch iterator over an :class:`RLHFDataset`.

    Epoch ``e`` visits the rows in ``permutation(seed, e)`` order (or in file order without shuffle), in batches
    of ``batch_size``; with ``drop_last`` an incomplete final batch is skipped. Iterating yields the remaining
    batches of the current epoch and then moves to the next epoch. ``state_dict()`` after a batch was yielded
    points at the following batch.
    """

    def __init__(self, dataset: RLHFDataset, batch_size: Optional[int], shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        self.dataset = dataset
        self.batch_size = len(dataset) if batch_size is None else int(batch_size)
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if drop_last and len(dataset) < self.batch_size:
            raise ValueError(f"the dataset has {len(dataset)} prompts, fewer than one batch of {self.batch_size}")
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_index = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch`` (a deterministic function of seed and epoch)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def batch_indices(self, epoch: int, batch_index: int) -> np.ndarray:
        """Dataset row indices of batch ``batch_index`` of ``epoch``."""
        order = self.epoch_order(epoch)
        return order[batch_index * self.batch_size:(batch_index + 1) * self.batch_size]

    def __iter__(self) -> Iterator[DataProto]:
        while self.batch_index < len(self):
            indices = self.batch_indices(self.epoch, self.batch_index)
            self.batch_index += 1
            yield self.dataset.collate(indices)
        self.epoch += 1
        self.batch_index = 0

    def state_dict(self) -> dict[str, int]:
        """Position (epoch, next batch) plus what must not change across a resume."""
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                "batch_size": self.batch_size, "num_samples": len(self.dataset), "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the position; the data size, batch size, seed and shuffle must match the saved ones."""
        current = self.state_dict()
        for key in ("seed", "batch_size", "num_samples", "shuffle"):
            if key in state and int(state[key]) != current[key]:
                raise ValueError(f"cannot resume the prompt loader: {key} was {state[key]} in the checkpoint "
                                 f"but is {current[key]} now (the training data or data.* config changed)")
        if not 0 <= int(state["batch_index"]) <= len(self):
            raise ValueError(f"checkpointed batch_index {state['batch_index']} out of range [0, {len(self)}]")
        self.epoch = int(state["epoch"])
        self.batch_index = int(state["batch_index"])


def create_dataset(files: Union[str, Sequence[str]], tokenizer, data_config: Any) -> RLHFDataset:
    """Build an :class:`RLHFDataset` from ``data.*`` settings (a DataConfig dataclass or DictConfig)."""
    return RLHFDataset(files, tokenizer, prompt_key=data_config.prompt_key,
                       max_prompt_length=data_config.max_prompt_length, truncation=data_config.truncation,
                       filter_overlong_prompts=data_config.filter_overlong_prompts)
