"""The rollout engine's log-probs and the agent turns through the dialogue loop (fast): with a programmed engine
that reports a distinct log-prob for every token it samples, `rollout_log_probs` holds exactly those values under
the agent's sampled tokens (0 under user turns, unsampled eos tokens, padding and error rows) and `agent_turn_ids`
the turn each came from (-1 elsewhere), in sync and async mode alike; the engine's contract is checked."""
from __future__ import annotations

import pytest
import torch

from llm_agent.generation import LLMGenerationManager
from llm_agent.envs import TokenBuffer
from verl.protocol import DataProto
from verl.utils.agent_turns import AGENT_TURN_IDS, agent_turn_ids

from tests.helpers.gen_loop_helpers import (FAIL, ProgrammedPolicy, ProgrammedSim, agent_text, make_gen_batch,
                                            programmed_log_probs, record_columns)
from tests.helpers.repo import SCENARIO_PATH

KEYS = ["fmt", "fail", "long", "claim", "ok"]
PER_TURN, BUDGET = 80, 330


def scripts(scenario):
    good = agent_text(scenario, "Hello, this is the ad platform.")
    claim = agent_text(scenario, "All done.", status=1)
    agent = {"fmt": ["no tags at all", good, good], "fail": [good, good], "long": ["word " * 400] * 3,
             "claim": [claim], "ok": [good, good, good]}
    user = {"fmt": [("Who?", 0), ("Yes.", 1)], "fail": [FAIL], "long": [], "claim": [("What?", 0)],
            "ok": [("Hi.", 0), ("Fine.", 0), ("Bye.", -1)]}
    return agent, user


def rollout(tok, scenario, mode: str, log_probs: bool = True, policy_cls=ProgrammedPolicy):
    agent, user = scripts(scenario)
    policy = policy_cls(tok, agent, log_probs=log_probs)
    cfg = {"scenario": str(SCENARIO_PATH), "mode": mode, "max_turns": 3, "max_tokens_per_turn": PER_TURN,
           "max_response_length": BUDGET, "cache": {"enabled": False}, "controller": {"enabled": False},
           "async_rollout": {"batch_wait_ms": 2.0, "max_batch_size": 2}}
    loop = LLMGenerationManager(tok, policy, cfg, is_validation=True, client=ProgrammedSim(scenario, user))
    return loop.run_llm_loop(make_gen_batch(tok, scenario, KEYS, meta={"do_sample": False})), policy


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of 1s in `mask`."""
    runs, start = [], None
    for j, m in enumerate([*mask, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            runs.append((start, j))
            start = None
    return runs


def test_log_probs_and_turns_sit_under_exactly_the_sampled_tokens_in_both_modes(tok, scenario):
    outs = {mode: rollout(tok, scenario, mode) for mode in ("sync", "async")}
    for key in ("rollout_log_probs", AGENT_TURN_IDS, "responses", "response_mask"):
        assert torch.equal(outs["sync"][0].batch[key], outs["async"][0].batch[key]), key
    out, policy = outs["async"]
    b, nt = out.batch, record_columns(out)
    assert dict(zip(KEYS, nt["outcome"])) == {"fmt": "completed", "fail": "error", "long": "truncated",
                                              "claim": "agent_ended", "ok": "hung_up"}
    assert b["rollout_log_probs"].dtype == torch.float32 and b["rollout_log_probs"].shape == (len(KEYS), BUDGET)
    for row, key in enumerate(KEYS):
        mask = b["response_mask"][row].tolist()
        expected_lp = torch.zeros(BUDGET)
        expected_turn = torch.full((BUDGET,), -1)
        runs = mask_runs(mask)
        if key == "fail":  # the error row carries no loss, no turn and no log-prob, though turn 0 was sampled
            assert runs == [] and (key, 0) in policy.returned
        else:
            assert len(runs) == nt["num_turns"][row]
        for turn, (start, end) in enumerate(runs):
            sampled = policy.returned[(key, turn)]
            assert b["responses"][row, start:end].tolist() == sampled[:end - start]
            expected_lp[start:end] = programmed_log_probs(key, turn, len(sampled))[:end - start]
            expected_turn[start:end] = turn
        assert torch.equal(b["rollout_log_probs"][row], expected_lp), key
        assert torch.equal(b[AGENT_TURN_IDS][row], expected_turn), key
    # "long": turns 0 and 1 were stopped by the per-turn limit and closed with an unsampled eos (mask 0, log-prob
    # 0); turn 2 was cut by the dialogue's budget
    row = KEYS.index("long")
    runs = mask_runs(b["response_mask"][row].tolist())
    assert [end - start for start, end in runs[:2]] == [PER_TURN, PER_TURN] and runs[-1][1] == BUDGET
    for _, end in runs[:2]:
        assert b["responses"][row, end] == tok.eos_token_id and b["rollout_log_probs"][row, end] == 0
    # the engine-side contract: turn ids are -1 exactly off the loss, so the trainer takes them as they are
    assert torch.equal(agent_turn_ids(b), b[AGENT_TURN_IDS])


def test_without_engine_log_probs_the_loop_still_writes_its_turns(tok, scenario):
    with_lp, _ = rollout(tok, scenario, "sync")
    without, _ = rollout(tok, scenario, "sync", log_probs=False)
    assert "rollout_log_probs" not in without.batch.keys()
    assert torch.equal(without.batch[AGENT_TURN_IDS], with_lp.batch[AGENT_TURN_IDS])


class SometimesLogProbs(ProgrammedPolicy):
    """Returns rollout_log_probs on its first call only."""

    def generate_sequences(self, data):
        out = super().generate_sequences(data)
        if len(self.calls) > 1:
            out.batch.pop("rollout_log_probs")
        return out


class ShortLogProbs(ProgrammedPolicy):
    """Returns rollout_log_probs one column short of the responses."""

    def generate_sequences(self, data):
        out = super().generate_sequences(data)
        return self.versioned(DataProto.from_dict(tensors={
            **{k: out.batch[k] for k in out.batch.keys()},
            "rollout_log_probs": out.batch["rollout_log_probs"][:, :-1]}))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_breaking_the_log_prob_contract_fails_the_rollout(tok, scenario, mode):
    with pytest.raises(ValueError, match="rollout_log_probs for some agent turns and not for others"):
        rollout(tok, scenario, mode, policy_cls=SometimesLogProbs)
    with pytest.raises(RuntimeError, match=r"rollout_log_probs of shape \(\d+, 79\) for responses of shape"):
        rollout(tok, scenario, mode, policy_cls=ShortLogProbs)


def test_token_buffer_keeps_log_probs_and_turns_beside_the_loss_mask():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    buf = TokenBuffer(ids, (ids != 0).long(), 8, 0)
    buf.append_sampled(0, [1, 2], 0, torch.tensor([-0.5, -1.5]))
    buf.append_context(0, [3])
    buf.append_sampled(0, [4], 1, torch.tensor([-2.5], dtype=torch.float64))
    buf.append_sampled(1, [1, 2, 3], 0, torch.tensor([-0.1, -0.2, -0.3]))
    with pytest.raises(ValueError, match="2 log-probs for 1 sampled tokens"):
        buf.append_sampled(1, [4], 1, torch.tensor([-0.1, -0.2]))
    with pytest.raises(ValueError, match="for some agent turns and not for others"):
        buf.append_sampled(1, [4], 1)
    buf.drop_loss(1)
    out = buf.final_tensors()
    assert out["responses"].tolist() == [[1, 2, 3, 4, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0], [0] * 8]
    assert out[AGENT_TURN_IDS].tolist() == [[0, 0, -1, 1, -1, -1, -1, -1], [-1] * 8]
    assert out["rollout_log_probs"].tolist() == [[-0.5, -1.5, 0, -2.5, 0, 0, 0, 0], [0.0] * 8]
