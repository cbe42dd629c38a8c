"""Rollout-loop behaviours that decide the training signal: malformed simulator replies are re-requested (not
silently dropped), out-of-range tags are format errors, and the cache's replies travel with a checkpoint."""
from __future__ import annotations

import pytest
import torch

from llm_agent.generation import CACHE_SNAPSHOT, LLMGenerationManager
from llm_agent.user_sim.client import SimulatorClient, TurnReply, TurnRequest

from tests.helpers.gen_loop_helpers import record_columns, column, ProgrammedPolicy, agent_text, make_gen_batch
from tests.helpers.repo import SCENARIO_PATH


class FlakySim(SimulatorClient):
    """Answers a dialogue's turn with `bad` for its first `bad_count[key]` requests, then a well-formed reply."""

    def __init__(self, scenario, bad_count: dict[str, int], bad: str = "<user_reply>  </user_reply>") -> None:
        self.scenario, self.bad_count, self.bad = scenario, dict(bad_count), bad
        self.requests: list[TurnRequest] = []

    def complete(self, requests):
        out = []
        for req in requests:
            self.requests.append(req)
            key = req.dialogue_id.split("#")[0]
            if self.bad_count.get(key, 0) > 0:
                self.bad_count[key] -= 1
                out.append(TurnReply(req.dialogue_id, self.bad, "fake:0", 0.0, 1))
            else:
                text = self.scenario.format_user_output("Okay.", {"cooperation": 3, "emotion": 2, "trust": 3}, 0)
                out.append(TurnReply(req.dialogue_id, text, "fake:0", 0.0, 1))
        return out


def _config(tmp_path, **overrides):
    cfg = {"scenario": str(SCENARIO_PATH), "max_turns": 1, "max_tokens_per_turn": 128, "max_response_length": 512,
           "max_user_tokens": 64, "cache": {"enabled": False}, "controller": {"enabled": False}}
    cfg.update(overrides)
    return cfg


def _run(tok, scenario, tmp_path, keys, sim, agent=None, **cfg):
    scripts = {k: [agent or agent_text(scenario, "Hello there.")] for k in keys}
    loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), _config(tmp_path, **cfg), is_validation=False,
                                client=sim)
    return loop, loop.run_llm_loop(make_gen_batch(tok, scenario, keys))


@pytest.mark.parametrize("bad", ["<user_reply>  </user_reply>", "no tags at all",
                                 "<user_reply>Fine.</user_reply><user_status>3</user_status>"])
def test_a_malformed_reply_is_re_requested_with_a_new_seed_and_the_dialogue_goes_on(tok, scenario, tmp_path, bad):
    """Before: one malformed reply made the dialogue `error` (dropped from loss, CR and controller)."""
    sim = FlakySim(scenario, {"a": 2, "b": 0}, bad)
    _, out = _run(tok, scenario, tmp_path, ["a", "b"], sim)
    nt = record_columns(out)
    assert list(nt["outcome"]) == ["timeout", "timeout"] and list(nt["sim_retries"]) == [2, 0]
    seeds = [r.seed for r in sim.requests if r.dialogue_id.startswith("a#")]
    assert len(seeds) == 3 and len(set(seeds)) == 3
    assert out.meta_info["metrics"]["rollout/error_rate"] == 0.0
    assert out.meta_info["metrics"]["rollout/sim_reply_retries"] == 2.0


def test_retries_are_bounded_and_a_dialogue_still_malformed_is_an_error(tok, scenario, tmp_path):
    sim = FlakySim(scenario, {"a": 5})
    _, out = _run(tok, scenario, tmp_path, ["a"], sim, user_sim={"reply_retries": 1})
    nt = record_columns(out)
    assert nt["outcome"][0] == "error" and nt["sim_retries"][0] == 1 and len(sim.requests) == 2
    assert "after 2 requests" in nt["error"][0] and out.batch["response_mask"][0].sum() == 0
    metrics = out.meta_info["metrics"]
    assert metrics["rollout/error_rate"] == 1.0 and metrics["rollout/completion_rate_all"] == 0.0


def test_an_out_of_range_stage_is_a_format_error_naming_the_valid_stages(tok, scenario, tmp_path):
    sim = FlakySim(scenario, {})
    text = "<response>Hello.</response><stage>7</stage><status>0</status>"
    loop, out = _run(tok, scenario, tmp_path, ["a"], sim, agent=text)
    turn = column(out, "turns")[0][0]
    assert turn["agent_stage"] is None and not turn["agent_format_ok"] and turn["user_source"] == "format_error"
    assert column(out, "format_errors")[0] == 1 and sim.requests == []
    assert turn["user_reply"] == loop.range_error_message and "0, 1, 2, 3" in loop.range_error_message


def test_loop_checkpoint_hooks_carry_the_cache_replies(tok, scenario, tmp_path):
    cache = {"enabled": True, "path": str(tmp_path / "live.jsonl"), "stage_hit_rates": {0: 0.5},
             "min_bucket_size": 1}
    sim = FlakySim(scenario, {})
    keys = [f"k{i}" for i in range(6)]
    loop, _ = _run(tok, scenario, tmp_path, keys, sim, cache=cache)
    held = len(loop.cache)
    assert held >= 1
    loop.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / CACHE_SNAPSHOT).is_file()
    loop.cache.add(0, "added after the checkpoint", {"cooperation": 3, "emotion": 2, "trust": 3}, 0)
    resumed = LLMGenerationManager(tok, ProgrammedPolicy(tok, {}), _config(tmp_path, cache=cache),
                                   is_validation=False, client=sim)
    assert len(resumed.cache) == held + 1
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert len(resumed.cache) == held


def test_row_alignment_check_catches_records_moved_without_their_tensors(tok, scenario, tmp_path):
    """The check test_sead_training applies after balancing must be able to fail."""
    from tests.helpers.row_alignment import misaligned_rows

    keys = ["a", "b", "c"]
    scripts = {k: [agent_text(scenario, f"Hello from {k}."), agent_text(scenario, f"Still {k} here.")]
               for k in keys}
    loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), _config(tmp_path, max_turns=2),
                                is_validation=False, client=FlakySim(scenario, {}))
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys))
    assert misaligned_rows(out, tok) == []
    balanced = out.select_idxs([0, 1, 2])
    balanced.reorder(torch.tensor([2, 0, 1]))  # tensors and records move together: still aligned
    assert misaligned_rows(balanced, tok) == []
    moved = out.select_idxs([0, 1, 2])
    for key, column in moved.non_tensor_batch.items():
        moved.non_tensor_batch[key] = column[[1, 2, 0]]
    assert misaligned_rows(moved, tok) == [0, 1, 2]


def test_controller_learns_from_every_sampled_dialogue_of_the_step_not_only_the_trained_batch(tok, scenario,
                                                                                               tmp_path):
    """With dynamic sampling the trained batch holds only mixed-outcome groups; the controller must still see the
    all-completed and all-failed groups (else its per-state completion rates are biased). A greedy ReMax baseline
    call (do_sample=False) is not a sampled dialogue and does not count."""
    keys = ["a", "b", "c"]
    scripts = {k: [agent_text(scenario, "Hello.")] for k in keys}
    loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), _config(tmp_path, controller={"enabled": True}),
                                is_validation=False, client=FlakySim(scenario, {}))
    first = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=["g1", "g2", "g3"]))
    loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=["g4", "g5", "g6"]))
    loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=["g4", "g5", "g6"], meta={"do_sample": False}))
    trained = first.select_idxs([0])  # what a filter kept
    metrics = loop.on_train_step_end(trained, step=1)
    assert metrics["controller/n"] == 6.0 and metrics["dialogue/n_dialogues"] == 1.0
    metrics = loop.on_train_step_end(trained, step=2)  # nothing generated since: falls back to the batch
    assert metrics["controller/n"] == 1.0


def test_the_loop_refuses_to_start_on_a_dead_simulator_url(tok, scenario, tmp_path):
    from llm_agent.user_sim.client import SimulatorCheckError
    from tests.helpers.sim_servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    cfg = _config(tmp_path, user_sim={"urls": dead, "timeout_s": 2})
    with pytest.raises(SimulatorCheckError, match=rf"{dead.split('//')[1]}: unreachable.*user_sim.urls"):
        LLMGenerationManager(tok, ProgrammedPolicy(tok, {}), cfg, is_validation=False)


class DeadSim(SimulatorClient):
    """Every turn fails, as with a wrong or dead simulator URL."""

    def complete(self, requests):
        from llm_agent.user_sim.client import TurnFailure

        return [TurnFailure(r.dialogue_id, "connection refused", 3, ["refused"]) for r in requests]


def test_training_stops_when_simulator_errors_persist(tok, scenario, tmp_path):
    keys = ["a", "b"]
    scripts = {k: [agent_text(scenario, "Hello.")] for k in keys}
    cfg = _config(tmp_path, user_sim={"max_error_rate": 0.5, "error_patience": 2})
    loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), cfg, is_validation=False, client=DeadSim())
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys))
    metrics = loop.on_train_step_end(out, step=1)
    assert metrics["user_sim/step_error_rate"] == 1.0 and metrics["user_sim/error_steps_in_a_row"] == 1.0
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys))
    with pytest.raises(RuntimeError, match=r"stopping at step 2: 100% of the step's 2 dialogues.*"
                                           r"error_patience=2.*connection refused"):
        loop.on_train_step_end(out, step=2)


def test_one_bad_step_does_not_stop_training(tok, scenario, tmp_path):
    keys = ["a", "b"]
    scripts = {k: [agent_text(scenario, "Hello.")] for k in keys}
    cfg = _config(tmp_path, user_sim={"max_error_rate": 0.5, "error_patience": 2})
    bad = LLMGenerationManager(tok, ProgrammedPolicy(tok, scripts), cfg, is_validation=False, client=DeadSim())
    good_client = FlakySim(scenario, {})
    for step, client in enumerate([DeadSim(), good_client, DeadSim(), good_client], start=1):
        bad.client = client
        out = bad.run_llm_loop(make_gen_batch(tok, scenario, keys))
        bad.on_train_step_end(out, step=step)  # never two bad steps in a row: no stop
