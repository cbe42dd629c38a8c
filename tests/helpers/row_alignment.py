"""An independent check that a batch row's tensors and its per-dialogue record belong to the same dialogue.

The loss-carrying runs of a row's `responses` (one contiguous run per agent turn: agent turns are separated by
loss-0 user blocks or an appended eos) are decoded from the tensors and compared with the agent texts of the
row's record. Tensors come from the loop's token buffer, records from its dialogue objects, so a reorder that moved
one without the other is caught.
"""
from __future__ import annotations

from verl.protocol import DataProto
from tests.helpers.gen_loop_helpers import column


def loss_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of `ids` where `mask` is 1, in order."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def misaligned_rows(batch: DataProto, tokenizer) -> list[int]:
    """Rows whose decoded agent turns differ from their record's `turns[*].agent_text` (error rows, whose loss
    mask is all 0 by design, are checked for that instead)."""
    bad = []
    for row in range(len(batch)):
        ids = batch.batch["responses"][row].tolist()
        mask = batch.batch["response_mask"][row].tolist()
        turns = column(batch, "turns")[row]
        if column(batch, "outcome")[row] == "error":
            if any(mask):
                bad.append(row)
            continue
        decoded = tokenizer.batch_decode(loss_runs(ids, mask), skip_special_tokens=True)
        if decoded != [t["agent_text"] for t in turns if t["agent_text"]]:
            bad.append(row)
    return bad
