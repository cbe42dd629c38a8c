"""Test doubles and batch builders for the rollout-loop tests (not the loop itself).

`ProgrammedPolicy` is a `RolloutEngine` stand-in that answers each dialogue's agent turn from a per-key script
(the key is written into the row's opening message as `[key]`) and records every id sequence it returned;
`ProgrammedSim` is a simulator client answering each dialogue from a per-key script of user replies or failures.
"""
from __future__ import annotations

import json
import re
import zlib

import numpy as np
import torch

from llm_agent.scenario import Scenario, UserProfile
from llm_agent.rollout.dialogue_record import records_from_batch
from llm_agent.user_sim.client import SimulatorClient, TurnFailure, TurnReply, TurnRequest
from verl.protocol import DataProto
from verl.workers.rollout.engine import RolloutEngine

from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.profiles import profile3

FAIL = "FAIL"
_KEY = re.compile(r"\[(\w+)\]")


def agent_text(scenario: Scenario, reply: str, stage: int = 0, status: int = 0, state=(2, 2, 2)) -> str:
    """A well-formed agent turn in the scenario's tag protocol."""
    return scenario.format_agent_output(reply, stage, status, dict(zip(scenario.dims, state)))


def column(out: DataProto, key: str) -> list:
    """Every row's `key` of its dialogue record, in the rollout log's JSON form (`DialogueRecord.to_dict`)."""
    return [record.to_dict()[key] for record in records_from_batch(out)]


def record_columns(out: DataProto) -> dict[str, list]:
    """{key: every row's value} of the rows' dialogue records, in the rollout log's JSON form."""
    rows = [record.to_dict() for record in records_from_batch(out)]
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def prompt_messages(scenario: Scenario, key: str) -> list[dict[str, str]]:
    """The agent prompt messages of one row, its opening tagged with `[key]`."""
    messages = scenario.render_agent_messages([])
    messages[-1] = {"role": "user", "content": f"{messages[-1]['content']} [{key}]"}
    return messages


def make_gen_batch(tokenizer, scenario: Scenario, keys: list[str], uids: list[str] | None = None,
                   profiles: list[UserProfile] | None = None, meta: dict | None = None) -> DataProto:
    """Left-padded chat-templated prompts for `keys` (one row each), with uid and user_profile columns."""
    rows = [tokenizer.encode(tokenizer.apply_chat_template(prompt_messages(scenario, k), tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
            for k in keys]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    profiles = profiles or [profile3(2, 2, 2)] * len(keys)
    uid = np.empty(len(keys), dtype=object)
    uid[:] = uids or keys
    prof = np.empty(len(keys), dtype=object)
    prof[:] = [json.dumps(p.to_dict()) for p in profiles]
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                               non_tensors={"uid": uid, "user_profile": prof}, meta_info=dict(meta or {}))


def programmed_log_probs(key: str, turn: int, n: int) -> torch.Tensor:
    """The log-probs ProgrammedPolicy reports for the n tokens of turn `turn` of dialogue `key`: distinct values
    in (-8, 0) drawn from a generator seeded by the key and the turn."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()) * 64 + turn)
    return -8.0 * torch.rand(n, generator=gen)


class ProgrammedPolicy(RolloutEngine):
    """A rollout engine answering turn t of dialogue `key` with `scripts[key][t]` (+ eos), cut to response_length;
    with `log_probs`, also `rollout_log_probs` (programmed_log_probs per sampled token, 0 after them), as an engine
    with `calculate_log_probs` does. `returned` keeps every (key, turn)'s returned ids."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], world_size: int = 2, log_probs: bool = False) -> None:
        self.tokenizer, self.scripts, self.world_size, self.log_probs = tokenizer, scripts, world_size, log_probs
        self.calls: list[dict] = []
        self.returned: dict[tuple[str, int], list[int]] = {}

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Answer every row; asserts the batch is a multiple of world_size and left-padded."""
        data = prompts
        assert len(data) % self.world_size == 0, f"{len(data)} rows for world size {self.world_size}"
        meta = data.meta_info
        length, eos, pad = meta["response_length"], meta["eos_token_id"], meta["pad_token_id"]
        ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
        assert torch.all(mask[:, -1] == 1), "prompts must be left-padded"
        self.calls.append({**meta, "rows": len(data), "width": ids.size(1)})
        out = torch.full((len(data), length), pad, dtype=torch.long)
        out_mask = torch.zeros(len(data), length, dtype=torch.long)
        log_probs = torch.zeros(len(data), length)
        for row in range(len(data)):
            context = self.tokenizer.decode(ids[row][mask[row].bool()].tolist())
            key = _KEY.search(context).group(1)
            turn = context.count("<|im_start|>assistant") - 1
            sampled = (self.tokenizer.encode(self.scripts[key][turn], add_special_tokens=False) + [eos])[:length]
            self.returned[(key, turn)] = sampled
            out[row, :len(sampled)] = torch.tensor(sampled)
            out_mask[row, :len(sampled)] = 1
            log_probs[row, :len(sampled)] = programmed_log_probs(key, turn, len(sampled))
        tensors = {"prompts": ids, "responses": out, "input_ids": torch.cat([ids, out], 1),
                   "attention_mask": torch.cat([mask, out_mask], 1),
                   "position_ids": torch.cat([data.batch["position_ids"],
                                              data.batch["position_ids"][:, -1:] + torch.arange(1, length + 1)], 1),
                   "response_mask": out_mask}
        if self.log_probs:
            tensors["rollout_log_probs"] = log_probs
        return self.versioned(DataProto.from_dict(tensors=tensors))


class ProgrammedSim(SimulatorClient):
    """Simulator client: the k-th heard agent turn of dialogue `key` gets `scripts[key][k]`.

    An entry is (reply, status) for a well-formed reply with state (2, 2, 2), FAIL for a TurnFailure, or a plain
    string sent verbatim (e.g. a reply without the reply tag).
    """

    def __init__(self, scenario: Scenario, scripts: dict[str, list]) -> None:
        self.scenario, self.scripts = scenario, scripts
        self.requests: list[TurnRequest] = []
        self.batches = 0

    def complete(self, requests: list[TurnRequest]) -> list[TurnReply | TurnFailure]:
        """Answer each request from its dialogue's script."""
        self.batches += 1
        results = []
        for req in requests:
            self.requests.append(req)
            key = req.dialogue_id.split("#")[0]
            heard = sum(m["role"] == "user" for m in req.messages) - 1
            entry = self.scripts[key][heard]
            if entry == FAIL:
                results.append(TurnFailure(req.dialogue_id, "all 3 attempts failed", 3, ["boom"]))
                continue
            text = entry if isinstance(entry, str) else self.scenario.format_user_output(
                entry[0], {"cooperation": 2, "emotion": 2, "trust": 2}, entry[1])
            results.append(TurnReply(req.dialogue_id, text, "fake:0", 0.0, 1))
        return results

    def calls_for(self, key: str) -> int:
        """How many requests dialogue `key` made."""
        return sum(r.dialogue_id.split("#")[0] == key for r in self.requests)


def greedy_rollouts_in_both_modes(tokenizer, worker_group, scenario: Scenario, keys: list[str], per_turn: int,
                                  budget: int, max_batch_size: int) -> dict[str, DataProto]:
    """The same validation batch (greedy, 3 turns, in-process scripted simulator) rolled out in sync and in async
    mode; {mode: output}."""
    from llm_agent.generation import LLMGenerationManager
    from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim

    outs = {}
    for mode in ("sync", "async"):
        cfg = {"scenario": str(SCENARIO_PATH), "mode": mode, "max_turns": 3, "max_tokens_per_turn": per_turn,
               "max_response_length": budget, "cache": {"enabled": False}, "controller": {"enabled": False},
               "async_rollout": {"max_batch_size": max_batch_size}}
        loop = LLMGenerationManager(tokenizer, worker_group, cfg, is_validation=True,
                                    client=InProcessUserSim(scenario))
        outs[mode] = loop.run_llm_loop(make_gen_batch(tokenizer, scenario, keys, meta={"do_sample": False}))
    return outs


def assert_same_dialogues(outs: dict[str, DataProto]) -> None:
    """Sync and async outputs carry the same tokens, masks, agent turns, outcomes and records, and the same
    rollout log-probs up to float rounding (other batch compositions pad the contexts differently)."""
    for key in ("responses", "response_mask", "attention_mask", "input_ids", "agent_turn_ids"):
        assert torch.equal(outs["sync"].batch[key], outs["async"].batch[key]), key
    assert ("rollout_log_probs" in outs["sync"].batch.keys()) == ("rollout_log_probs" in outs["async"].batch.keys())
    if "rollout_log_probs" in outs["sync"].batch.keys():
        torch.testing.assert_close(outs["sync"].batch["rollout_log_probs"], outs["async"].batch["rollout_log_probs"],
                                   rtol=0, atol=1e-4)
    for key in ("outcome", "turns", "messages", "num_turns"):
        assert column(outs["sync"], key) == column(outs["async"], key), key
