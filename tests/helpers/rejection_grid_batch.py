"""The sampled dialogue batch of the rejection x credit grid (tests/verl/trainer/ppo/test_rejection_credit_grid.py):
12 rows in 4 prompt groups of 3, left-padded prompts, responses of 1-5 agent turns with user turns between them
and right padding, everything the advantage step reads (rewards, values, per-turn scores and labels, ReMax
baselines, the engine's and the policy's log-probs), and the situations the grid must meet, by construction:

- row 0: its last agent turn is stale (off-policy), so turn-level rejection drops the last turn;
- row 2: every agent turn is stale, so turn- and sequence-level rejection drop the whole row;
- row 3: only its last token (the one carrying its outcome reward, 1) is far off-policy;
- row 4: its agent-turn ids skip 1 (a turn without tokens), its labels carry an entry for it;
- every stale turn carries a non-zero turn score on its last token.

Stale tokens get a log-ratio (policy - engine) of N(0, 0.6); the others N(0, 0.02).
"""
from __future__ import annotations

import random

import numpy as np
import torch

from verl.protocol import DataProto

ROWS, GROUP, PROMPT, RESPONSE = 12, 3, 8, 48
LABELS = ("false_claim", "premature_push", "not_weighted")
LABEL_WEIGHTS = {"false_claim": 1.5, "premature_push": 0.5}
STALE_ROW_LAST_TURN, STALE_ROW, LAST_TOKEN_ROW, GAP_ROW = 0, 2, 3, 4


def _layout(rng: random.Random) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Per row: agent-turn id of every response position (-1 off the agent turns), attention of the response
    part (1 up to the dialogue's end), and the stale turn ids."""
    ids, attention, stale = [], [], []
    for row in range(ROWS):
        turns = {STALE_ROW_LAST_TURN: 3, STALE_ROW: 2, LAST_TOKEN_ROW: 3, GAP_ROW: 3}.get(row, rng.randint(1, 5))
        numbers = [0, 2, 3] if row == GAP_ROW else list(range(turns))
        line, pos = [-1] * RESPONSE, 0
        for k in numbers:
            run = rng.randint(2, 5) if row == LAST_TOKEN_ROW else rng.randint(1, 5)
            for t in range(pos, pos + run):
                line[t] = k
            pos += run + rng.randint(1, 4)  # the user's reply after the agent's turn
        end = pos if rng.random() < 0.5 else pos - 1  # some dialogues end on the user's reply
        end = min(end, RESPONSE)
        ids.append(line)
        attention.append([1 if t < end else 0 for t in range(RESPONSE)])
        if row == STALE_ROW_LAST_TURN:
            stale.append([numbers[-1]])
        elif row == STALE_ROW:
            stale.append(list(numbers))
        elif row == LAST_TOKEN_ROW:
            stale.append([])
        else:
            stale.append([k for k in numbers if rng.random() < 1 / 3])
    return ids, attention, stale


def sampled_batch(vocab_size: int, seed: int = 0) -> DataProto:
    """The grid's batch as the rollout and reward left it, with ``rollout_log_probs`` but ``old_log_probs`` 0
    (the caller puts the policy's log-probs there, see :func:`with_log_probs`)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ids_rows, attention_rows, stale = _layout(rng)
    turn_ids = torch.tensor(ids_rows, dtype=torch.long)
    mask = (turn_ids >= 0).long()
    prompt_lengths = [rng.randint(3, PROMPT) for _ in range(ROWS)]
    prompt_attention = torch.tensor([[0] * (PROMPT - n) + [1] * n for n in prompt_lengths])
    attention = torch.cat([prompt_attention, torch.tensor(attention_rows)], dim=1)
    input_ids = torch.randint(4, vocab_size, (ROWS, PROMPT + RESPONSE), generator=gen)
    input_ids = torch.where(attention.bool(), input_ids, torch.full_like(input_ids, 3))
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)

    rewards = -0.02 * torch.rand(ROWS, RESPONSE, generator=gen, dtype=torch.float64) * mask
    turn_scores = torch.zeros(ROWS, RESPONSE, dtype=torch.float64)
    log_ratio = torch.randn(ROWS, RESPONSE, generator=gen, dtype=torch.float64) * 0.02
    labels = np.empty(ROWS, dtype=object)
    per_row_labels = []
    for i in range(ROWS):
        positions = [t for t in range(RESPONSE) if ids_rows[i][t] >= 0]
        last = positions[-1]
        outcome = i == LAST_TOKEN_ROW or rng.random() < 0.5  # row 3 succeeds: its rejected last token carries 1
        rewards[i, last] += float(outcome)  # the outcome, on the dialogue's last agent token
        numbers = sorted({ids_rows[i][t] for t in positions})
        for k in numbers:
            tokens = [t for t in positions if ids_rows[i][t] == k]
            if k in stale[i] or rng.random() < 0.7:
                score = rng.gauss(0.0, 0.5)
                turn_scores[i, tokens[-1]] = score if abs(score) > 0.05 else 0.1
            if k in stale[i]:
                log_ratio[i, tokens] = torch.randn(len(tokens), generator=gen, dtype=torch.float64) * 0.6
        if i == LAST_TOKEN_ROW:
            log_ratio[i, last] = 1.5
        per_row_labels.append([[label for label in LABELS if rng.random() < 0.3] for _ in range(max(numbers) + 1)])
    labels[:] = per_row_labels
    values = torch.randn(ROWS, RESPONSE, generator=gen, dtype=torch.float64) * 0.5
    tensors = {
        "prompts": input_ids[:, :PROMPT], "responses": input_ids[:, PROMPT:], "input_ids": input_ids,
        "attention_mask": attention, "position_ids": position_ids, "response_mask": mask,
        "agent_turn_ids": torch.where(mask.bool(), turn_ids, -1), "token_level_scores": rewards.clone(),
        "token_level_rewards": rewards, "turn_scores": turn_scores, "values": values,
        "reward_baselines": torch.randn(ROWS, generator=gen, dtype=torch.float64) * 0.3,
        "old_log_probs": torch.zeros(ROWS, RESPONSE, dtype=torch.float64),
        "rollout_log_probs": -log_ratio * mask,  # old - rollout = log_ratio once old_log_probs are set
    }
    uid = np.array([f"g{i // GROUP}" for i in range(ROWS)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid, "turn_labels": labels},
                               meta_info={"temperature": 1.0})


def with_log_probs(batch: DataProto, log_probs: torch.Tensor) -> DataProto:
    """``batch`` with the policy's log-probs as ``old_log_probs`` and the engine's shifted by the same amount
    (the log-ratio between them is kept), 0 outside the mask as an engine returns them."""
    mask = batch.batch["response_mask"].bool()
    log_ratio = -batch.batch["rollout_log_probs"]
    old = torch.where(mask, log_probs.double(), torch.zeros_like(log_ratio))
    batch.batch["old_log_probs"] = old
    batch.batch["rollout_log_probs"] = torch.where(mask, old - log_ratio, torch.zeros_like(old))
    return batch


def reference_log_probs(model: torch.nn.Module, batch: DataProto) -> torch.Tensor:
    """The responses' log-probs under a plain HF forward of the padded rows in float64 (the policy's, for the
    reference: the actor's own pass is checked against them)."""
    b = batch.batch
    model = model.double().eval()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, PROMPT - 1:-1]
    return torch.log_softmax(logits.double(), -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
