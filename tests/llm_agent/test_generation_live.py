"""The rollout loop against real components (slow): two scripted simulator servers with one SIGKILLed mid-loop,
and the tiny model sampling through a real 2-rank RayWorkerGroup of ActorRolloutRefWorker (tokens and masks,
sync == async, the HF rollout's log-probs against an independent recomputation)."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoTokenizer

from llm_agent.generation import LLMGenerationManager
from llm_agent.scenario import UserProfile, UserTurn, load_scenario
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from llm_agent.user_sim.client import TurnRequest
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim

from tests.helpers.gen_loop_helpers import (assert_same_dialogues, column, greedy_rollouts_in_both_modes,
                                            make_gen_batch, record_columns)
from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.sim_servers import SimServers
from verl.workers.rollout.engine import RolloutEngine
from verl.workers.rollout.replicas import WorkerGroupEngine

pytestmark = pytest.mark.processes


class KillDuringTurn(RolloutEngine):
    """Fault injection around the policy: when its `at_call`-th generation returns, SIGKILL a simulator server
    `delay_s` later, i.e. while that turn's simulator requests are in flight."""

    def __init__(self, wg, servers: SimServers, url: str, at_call: int, delay_s: float) -> None:
        self.wg, self.servers, self.url, self.at_call, self.delay_s = wg, servers, url, at_call, delay_s
        self.world_size = wg.world_size
        self.n = 0
        self.timer: threading.Timer | None = None

    def generate_sequences(self, data):
        out = self.wg.generate_sequences(data)
        self.n += 1
        if self.n == self.at_call:
            self.timer = threading.Timer(self.delay_s, self.servers.kill, args=(self.url,))
            self.timer.start()
        return out


def replay_matches(scenario, record) -> None:
    """Every simulator turn of `record` is what the scripted persona answers to this dialogue's own history."""
    sim = InProcessUserSim(scenario)
    profile = UserProfile.from_dict(record["profile"])
    history = []
    for k, turn in enumerate(record["turns"]):
        agent = scenario.parse_agent_output(turn["agent_text"])
        if turn["user_source"] == "format_error" or turn["user_source"] is None:
            continue
        history.append(agent)
        messages = scenario.render_user_messages(profile, history)
        reply = sim.complete([TurnRequest(record["dialogue_id"], messages, temperature=0.0)])[0]
        expected = scenario.parse_user_output(reply.text)
        got = (turn["user_reply"], turn["user_status"], turn["user_state"])
        assert got == (expected.reply, expected.status, expected.state), f"{record['dialogue_id']} turn {k}"
        history.append(UserTurn(raw="", reply=turn["user_reply"], status=turn["user_status"],
                                state=dict(turn["user_state"])))


def outcome_from_transcript(record, max_turns: int) -> str | None:
    last = record["turns"][-1]
    if last["user_status"] == 1:
        return "completed"
    if last["user_status"] == -1:
        return "hung_up"
    if last["agent_status"] in (1, -1) and last["agent_format_ok"]:
        return "agent_ended"
    if record["num_turns"] == max_turns and last["user_source"] is not None:
        return "timeout"
    return None  # truncated (or error) cannot be read from the turns alone


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_loop_survives_a_simulator_killed_mid_loop(mode, tiny_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    scenario = load_scenario(SCENARIO_PATH)
    servers = SimServers(tmp_path)
    try:
        latency = ("--inject-latency-ms", "150", "--inject-latency-sigma", "0.2")
        a, b = servers.start(*latency), servers.start(*latency)
        servers.wait_ready(a, b)
        cfg = {"scenario": str(SCENARIO_PATH), "mode": mode, "max_turns": 8, "max_tokens_per_turn": 256,
               "max_response_length": 3072, "cache": {"enabled": False}, "controller": {"enabled": True, "seed": 1},
               "user_sim": {"urls": [a, b], "timeout_s": 5, "max_attempts": 4, "temperature": 0.0}}
        policy = KillDuringTurn(ScriptedPolicyWorkerGroup(tok, scenario, world_size=2), servers, a, at_call=2,
                                delay_s=0.05)
        loop = LLMGenerationManager(tok, policy, cfg, is_validation=False)
        keys = [f"p{i}" for i in range(12) for _ in range(2)]
        try:
            out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=keys))
            metrics = loop.on_train_step_end(out, step=1)
        finally:
            loop.close()
        assert servers.procs[a].poll() is not None, "the server was not killed during the loop"
    finally:
        servers.stop_all()
    nt = record_columns(out)
    assert len(out) == 24 and len(set(nt["dialogue_id"])) == 24
    assert "error" not in set(nt["outcome"]), list(nt["error"])
    name_a = a.split("//")[1]
    assert metrics[f"user_sim/{name_a}/failures"] > 0 and metrics["dialogue/error_rate"] == 0.0
    records = [{k: nt[k][i] for k in nt} for i in range(len(out))]
    for record in records:
        expected = outcome_from_transcript(record, 8)
        assert expected in (record["outcome"], None), record["dialogue_id"]
        assert (record["outcome"] == "completed") == (record["turns"][-1]["user_status"] == 1)
        replay_matches(scenario, record)
    assert {"completed"} & set(nt["outcome"]), set(nt["outcome"])


@pytest.fixture(scope="module")
def actor_group(tiny_model_path):
    """A 2-rank HF actor_rollout group of the tiny model with calculate_log_probs, shared by the module's tests
    (its start, ~50 s on a loaded 2-core box, is what makes them slow)."""
    import ray
    from tests.helpers.ppo_batch_helpers import actor_rollout_ref_config

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    pool = RayResourcePool([2], use_gpu=False, name_prefix="gen_loop_pool")
    group = None
    try:
        config = actor_rollout_ref_config(tiny_model_path, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1)
        config.rollout.calculate_log_probs = True
        group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config, role="actor_rollout"),
                               name_prefix="gen_loop_actor")
        group.init_model()
        yield WorkerGroupEngine(group)
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()
        ray.shutdown()


@pytest.mark.slow
def test_real_policy_tokens_and_masks(actor_group, tiny_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    scenario = load_scenario(SCENARIO_PATH)
    per_turn, budget = 12, 200
    cfg = {"scenario": str(SCENARIO_PATH), "max_turns": 3, "max_tokens_per_turn": per_turn,
           "max_response_length": budget, "cache": {"enabled": False}, "controller": {"enabled": False}}
    loop = LLMGenerationManager(tok, actor_group, cfg, is_validation=True, client=InProcessUserSim(scenario))
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, ["r0", "r1", "r2"], meta={"do_sample": False}))
    eos, b, nt = tok.eos_token_id, out.batch, record_columns(out)
    assert b["responses"].shape == (3, budget)
    assert torch.equal(b["input_ids"][:, -budget:], b["responses"])
    for i in range(3):
        n = int(b["attention_mask"][i, -budget:].sum())
        ids, mask = b["responses"][i, :n].tolist(), b["response_mask"][i, :n].tolist()
        assert b["response_mask"][i, n:].sum() == 0 and b["responses"][i, n:].eq(tok.pad_token_id).all()
        segments, start = [], 0  # maximal runs of one mask value
        for j in range(1, n + 1):
            if j == n or mask[j] != mask[start]:
                segments.append((mask[start], ids[start:j]))
                start = j
        turns, shown = nt["turns"][i], [m["content"] for m in nt["messages"][i] if m["role"] == "user"]
        agent_i = user_i = 0
        closed = True
        for value, seg in segments:
            if value == 1:  # one agent turn: exactly what was sampled, decoded into the record
                assert tok.decode(seg, skip_special_tokens=True) == turns[agent_i]["agent_text"]
                assert eos not in seg[:-1] and len(seg) <= per_turn
                closed = seg[-1] == eos
                if not closed and not (nt["outcome"][i] == "truncated" and agent_i == len(turns) - 1):
                    assert len(seg) == per_turn  # stopped by the per-turn limit
                agent_i += 1
                continue
            head = [] if closed else [eos]  # an unsampled eos closes a turn cut by the limit (mask 0)
            assert seg[:len(head)] == head
            if seg[len(head):]:
                expected = f"\n<|im_start|>user\n{shown[user_i]}<|im_end|>\n<|im_start|>assistant\n"
                assert tok.decode(seg[len(head):]) == expected
                user_i += 1
        assert agent_i == nt["num_turns"][i] and nt["outcome"][i] != "error"


@pytest.mark.slow
def test_real_policy_greedy_dialogues_are_identical_in_sync_and_async_mode(actor_group, tiny_model_path):
    """The tiny model on 2 FSDP ranks, greedy, against the deterministic scripted persona: the async loop (other
    batch compositions, a size cap of 3 rows) yields the sync loop's tokens, masks, outcomes and records."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    outs = greedy_rollouts_in_both_modes(tok, actor_group, load_scenario(SCENARIO_PATH), [f"r{i}" for i in range(5)],
                                         per_turn=16, budget=200, max_batch_size=3)
    assert_same_dialogues(outs)
    assert outs["async"].meta_info["metrics"]["rollout/generate_batches"] > \
        outs["sync"].meta_info["metrics"]["rollout/generate_batches"]


def recomputed_log_probs(model_path: str, batch, temperature: float) -> torch.Tensor:
    """(bs, R) log softmax(logits / temperature) of each response token under the model at `model_path` (fp32 HF
    forward of each row's whole prompt + response, its own padding and positions), the actor's definition."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    R = batch.batch["responses"].size(1)
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits[:, -R - 1:-1].double()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    return log_probs.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.slow
def test_real_policy_rollout_log_probs_match_an_independent_recomputation(actor_group, tiny_model_path):
    """The HF rollout on 2 FSDP ranks with calculate_log_probs, sampling at temperature 0.8, in both modes: under
    every sampled agent token the dialogue's `rollout_log_probs` is the token's log-prob under the same weights
    recomputed by a plain HF forward over the whole dialogue (temperature applied); 0 elsewhere."""
    from verl.utils.agent_turns import agent_turn_ids_from_mask

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    scenario = load_scenario(SCENARIO_PATH)
    temperature = 0.8
    for mode in ("sync", "async"):
        cfg = {"scenario": str(SCENARIO_PATH), "mode": mode, "max_turns": 3, "max_tokens_per_turn": 12,
               "max_response_length": 200, "cache": {"enabled": False}, "controller": {"enabled": False},
               "async_rollout": {"max_batch_size": 2}}
        loop = LLMGenerationManager(tok, actor_group, cfg, is_validation=True, client=InProcessUserSim(scenario))
        out = loop.run_llm_loop(make_gen_batch(tok, scenario, [f"s{i}" for i in range(4)],
                                               meta={"do_sample": True, "temperature": temperature}))
        b = out.batch
        mask = b["response_mask"].bool()
        assert int(mask.sum()) > 0 and max(column(out, "num_turns")) >= 2, mode
        expected = recomputed_log_probs(tiny_model_path, out, temperature)
        got = b["rollout_log_probs"].double()
        assert float((got - expected).abs()[mask].max()) < 1e-4, mode
        assert not got[~mask].any(), mode
        assert torch.equal(b["agent_turn_ids"], agent_turn_ids_from_mask(b["response_mask"])), mode
