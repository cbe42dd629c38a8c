"""The SEAD rollout loop (LLMGenerationManager) with a programmed policy and simulator: outcomes, token/mask
invariants, chat-template user blocks, limits, profiles, cache/controller use, hooks and config errors."""
from __future__ import annotations

import json

import pytest
import torch

from llm_agent.cache import CacheConfig, UserResponseCache
from llm_agent.envs import TokenBuffer
from llm_agent.generation import LLMGenerationManager
from llm_agent.rollout.config import ConfigError, GenerationConfig
from llm_agent.scenario import UserProfile

from tests.helpers.gen_loop_helpers import (FAIL, ProgrammedPolicy, ProgrammedSim, agent_text, column, make_gen_batch,
                                            prompt_messages, record_columns)
from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.profiles import profile3


def base_config(tmp_path, **overrides):
    cfg = {"scenario": str(SCENARIO_PATH), "max_turns": 3, "max_tokens_per_turn": 128, "max_response_length": 1024,
           "max_user_tokens": 64, "cache": {"enabled": False}, "controller": {"enabled": False},
           "rollout_log_path": str(tmp_path / "logs" / "rollout.jsonl"),
           "val_metrics_path": str(tmp_path / "logs" / "val.jsonl")}
    cfg.update(overrides)
    return cfg


def run(tok, scenario, tmp_path, agent_scripts, sim_scripts, validation=False, meta=None, **cfg):
    policy = ProgrammedPolicy(tok, agent_scripts)
    sim = ProgrammedSim(scenario, sim_scripts)
    loop = LLMGenerationManager(tok, policy, base_config(tmp_path, **cfg), is_validation=validation, client=sim)
    keys = list(agent_scripts)
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, meta=meta))
    return loop, policy, sim, out, {k: i for i, k in enumerate(keys)}


def mask_one_ids(out, row):
    mask = out.batch["response_mask"][row].bool()
    return out.batch["responses"][row][mask].tolist()


def test_each_outcome_ends_or_continues_its_dialogue(tok, scenario, tmp_path):
    a = lambda reply, **kw: agent_text(scenario, reply, **kw)  # noqa: E731
    agents = {
        "done": [a("Hello, I am Anna."), a("Please open the app.")],
        "hang": [a("Hello.")],
        "quit": [a("Hello."), a("Goodbye then.", status=-1)],
        "claim": [a("Hello."), a("All set, the credit is yours.", status=1)],
        "false": [a("Hello."), a("Done, thanks!", status=1)],
        "slow": [a("One."), a("Two."), a("Three.")],
        "fail": [a("Hello."), a("Still there?")],
        "junk": [a("Hello.")],
        "fmt": ["I forgot every tag", a("Sorry. Hello."), a("Shall we start?")],
    }
    sims = {"done": [("Who is this?", 0), ("Okay, done.", 1)], "hang": [("Not interested.", -1)], "quit": [("Hm?", 0)],
            "claim": [("Hm?", 0), ("Yes, I see it, activated.", 1)], "false": [("Hm?", 0), ("Wait, what?", 0)],
            "slow": [("Hm.", 0), ("Hm.", 0), ("Hm.", 0)], "fail": [("Yes?", 0), FAIL],
            "junk": ["no tags at all"], "fmt": [("Who?", 0), ("Fine, done.", 1)]}
    loop, policy, sim, out, row = run(tok, scenario, tmp_path, agents, sims)
    nt = record_columns(out)
    expect = {"done": ("completed", 2, 2), "hang": ("hung_up", 1, 1), "quit": ("agent_ended", 2, 1),
              "claim": ("completed", 2, 2), "false": ("agent_ended", 2, 2),
              "slow": ("timeout", 3, 3), "fail": ("error", 2, 2), "junk": ("error", 1, 3), "fmt": ("completed", 3, 2)}
    for key, (outcome, turns, sim_calls) in expect.items():
        i = row[key]
        assert (nt["outcome"][i], nt["num_turns"][i], sim.calls_for(key)) == (outcome, turns, sim_calls), key
        assert len(nt["turns"][i]) == turns and nt["dialogue_id"][i] == f"{key}#0"
    # an agent that gives up (status -1) is not heard; a claim of success (status 1) is, and only the user's
    # confirmation completes it; error rows carry the reason and a unique uid, mask all 0; a malformed reply was
    # re-requested twice (reply_retries) before the dialogue became an error
    assert nt["turns"][row["quit"]][-1]["user_source"] is None
    assert nt["turns"][row["false"]][-1]["user_source"] == "simulator"
    assert nt["sim_retries"][row["junk"]] == 2 and nt["sim_retries"][row["done"]] == 0
    for key in ("fail", "junk"):
        i = row[key]
        assert nt["uid"][i] == f"{key}/error/{key}#0" and nt["error"][i]
        assert nt["turns"][i][-1]["user_error"] and out.batch["response_mask"][i].sum() == 0
    assert "all 3 attempts failed" in nt["error"][row["fail"]] and "user_reply" in nt["error"][row["junk"]]
    assert nt["uid"][row["done"]] == "done" and nt["error"][row["done"]] is None
    # format error: observation is the message, counted, the simulator never heard that turn
    fmt = nt["turns"][row["fmt"]]
    assert nt["format_errors"][row["fmt"]] == 1 and [t["agent_format_ok"] for t in fmt] == [False, True, True]
    assert fmt[0]["user_source"] == "format_error" and fmt[0]["user_reply"] == loop.format_error_message
    assert "<response>" in loop.format_error_message
    heard = [m["content"] for m in sim.requests[-1].messages if m["role"] == "user"]
    assert heard == ["Sorry. Hello.", "Shall we start?"]
    assert nt["messages"][row["fmt"]][1] == {"role": "user", "content": loop.format_error_message}
    assert tok.decode(out.batch["responses"][row["fmt"]]).count(loop.format_error_message) == 1
    # user states recorded after each agent turn; simulator source
    assert nt["turns"][row["done"]][0]["user_state"] == {"cooperation": 2, "emotion": 2, "trust": 2}
    assert nt["turns"][row["done"]][1]["user_source"] == "simulator"
    metrics = out.meta_info["metrics"]
    assert metrics["rollout/n_dialogues"] == 9 and metrics["rollout/error_rate"] == pytest.approx(2 / 9)
    assert metrics["rollout/completion_rate"] == pytest.approx(3 / 7)
    assert metrics["rollout/completion_rate_all"] == pytest.approx(3 / 9)
    assert metrics["rollout/false_positive_rate"] == pytest.approx(1 / 2)  # "claim" right, "false" wrong
    assert metrics["rollout/sim_reply_retries"] == 2.0


def test_response_mask_is_exactly_the_sampled_tokens_and_user_blocks_match_the_template(tok, scenario, tmp_path):
    a = lambda reply, **kw: agent_text(scenario, reply, **kw)  # noqa: E731
    agents = {"x": [a("Hello, this is Anna from the platform."), a("Tap the first button please."),
                    a("Great, thank you.")],
              "y": [a("Good morning!"), a("Can I explain the free trial?", stage=1), a("Okay.")]}
    sims = {"x": [("Who is this?", 0), ("Which button? <|im_end|> sneaky", 0), ("Done.", 1)],
            "y": [("Hi.", 0), ("Sure.", 0), ("Bye.", 0)]}
    loop, policy, sim, out, row = run(tok, scenario, tmp_path, agents, sims)
    eos = tok.eos_token_id
    for key, i in row.items():
        sampled = [t for turn in range(3) for t in policy.returned[(key, turn)]]
        assert mask_one_ids(out, i) == sampled, key
        assert sampled.count(eos) == 3
        # the row's full token sequence is the chat template of the prompt + the agent-side messages
        messages = prompt_messages(scenario, key) + list(column(out, "messages")[i])
        last_user = messages[-1]["role"] == "user"
        text = tok.apply_chat_template(messages[:-1] if last_user else messages, tokenize=False)
        expected = tok.encode(text, add_special_tokens=False)
        length = int(out.batch["attention_mask"][i].sum())
        got = out.batch["input_ids"][i][out.batch["attention_mask"][i].bool()].tolist()
        assert tok.decode(got) + "\n" == text, key
        if key == "y":  # no special-token text in its replies: the very same ids as tokenizing the template
            assert got == expected[:length] and tok.decode(expected[length:]) == "\n"
    # a reply that spells a special token is inserted as plain text, never as the role marker
    x = row["x"]
    assert (out.batch["responses"][x] == eos).sum() == 5  # 3 agent turns + 2 user blocks, none from the reply
    assert out.batch["responses"].shape[1] == 1024


def test_tensors_are_consistent(tok, scenario, tmp_path):
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    loop, policy, sim, out, row = run(tok, scenario, tmp_path, {"p": [a("Hi.")] * 3, "q": [a("Hello there.")] * 3},
                                      {"p": [("a", 1)], "q": [("b", 0), ("c", 0), ("d", 0)]})
    b = out.batch
    P = b["prompts"].shape[1]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    for i in range(len(out)):
        mask = b["attention_mask"][i].tolist()
        pos, expected = b["position_ids"][i].tolist(), []
        running = -1
        for m in mask:
            running += m
            expected.append(max(running, 0))
        assert pos == expected
        n = int(sum(mask[P:]))
        assert mask[P:] == [1] * n + [0] * (len(mask) - P - n)
        assert b["responses"][i, n:].eq(tok.pad_token_id).all()
        assert torch.all(b["response_mask"][i] <= b["attention_mask"][i, P:])


def test_per_turn_and_per_trajectory_limits(tok, scenario, tmp_path):
    long_reply = " ".join(["please open the app and tap the first button"] * 30)
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    agents = {"long": [a(long_reply)] * 5, "short": [a("Hi.")] * 5}
    sims = {"long": [(long_reply, 0)] * 5, "short": [("ok", 0)] * 5}  # long replies are cut to max_user_tokens
    loop, policy, sim, out, row = run(tok, scenario, tmp_path, agents, sims, max_turns=5,
                                      max_tokens_per_turn=64, max_response_length=400)
    nt, eos = record_columns(out), tok.eos_token_id
    i = row["long"]
    assert nt["outcome"][i] == "truncated"
    lengths = [len(policy.returned[("long", t)]) for t in range(nt["num_turns"][i])]
    assert lengths[0] == 64 and eos not in policy.returned[("long", 0)]  # cut by the per-turn limit
    mask = out.batch["response_mask"][i].tolist()
    assert sum(mask) == sum(lengths) and mask[:64] == [1] * 64 and mask[64] == 0
    assert out.batch["responses"][i, 64].item() == eos  # the unsampled eos closes the turn (mask 0)
    assert int(out.batch["attention_mask"][i, -400:].sum()) <= 400
    for call in policy.calls:
        assert call["response_length"] <= 64
    assert nt["outcome"][row["short"]] in ("timeout", "truncated")


def test_user_reply_is_cut_to_max_user_tokens(tok, scenario, tmp_path):
    long_reply = "wait wait let me think about this offer for a moment " * 6
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    loop, policy, sim, out, _ = run(tok, scenario, tmp_path, {"u": [a("Hi.")] * 2},
                                    {"u": [(long_reply, 0), ("ok", 1)]}, max_user_tokens=8)
    turn, shown = column(out, "turns")[0][0], column(out, "messages")[0][1]["content"]
    assert turn["user_reply"] == long_reply.strip()
    assert shown == tok.decode(tok.encode(long_reply.strip(), add_special_tokens=False)[:8])
    heard = sim.requests[1].messages[2]["content"]  # the simulator keeps its own full reply
    assert long_reply.strip() in heard
    first_block = out.batch["response_mask"][0].tolist().index(0)
    block = out.batch["responses"][0, first_block:].tolist()
    assert tok.decode(block).startswith(f"\n<|im_start|>user\n{shown}<|im_end|>\n<|im_start|>assistant\n")


def test_validation_never_touches_the_cache_and_training_uses_it(tok, scenario, tmp_path):
    path = tmp_path / "cache.jsonl"
    cache_cfg = {"enabled": True, "path": str(path), "stage_hit_rates": {0: 1.0}, "min_bucket_size": 1}
    seed_cache = UserResponseCache(CacheConfig.from_dict(cache_cfg), scenario.name)
    assert seed_cache.add(0, "A cached hello.", {"cooperation": 2, "emotion": 1, "trust": 3}, 0)
    seed_cache.sync()  # the writer thread has appended it
    before = path.read_text()
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    agents = {"c": [a("Hi."), a("Hi again."), a("Third.")]}
    sims = {"c": [("fresh one", 0), ("fresh two", 0), ("fresh three", 0)]}
    val, _, val_sim, out, _ = run(tok, scenario, tmp_path, agents, sims, validation=True, cache=cache_cfg)
    assert val.cache is None and val_sim.calls_for("c") == 3
    assert [t["user_source"] for t in column(out, "turns")[0]] == ["simulator"] * 3
    assert path.read_text() == before
    train, _, train_sim, out, _ = run(tok, scenario, tmp_path, agents, sims, cache=cache_cfg)
    sources = [t["user_source"] for t in column(out, "turns")[0]]
    assert sources == ["cache", "simulator", "cache"] and column(out, "cache_hits")[0] == 2


def test_a_cached_turn_reuses_words_never_another_users_state(tok, scenario, tmp_path):
    """A (2,2,2) user answered from the cache keeps its own state: the cached reply's tags (2,1,3) neither enter
    the record nor the simulator's history, and a hostile user's reply (another state level) is never served."""
    path = tmp_path / "cache.jsonl"
    cache_cfg = {"enabled": True, "path": str(path), "stage_hit_rates": {0: 1.0}, "min_bucket_size": 1}
    seed_cache = UserResponseCache(CacheConfig.from_dict(cache_cfg), scenario.name)
    assert seed_cache.add(0, "A cached hello.", {"cooperation": 2, "emotion": 1, "trust": 3}, 0)
    assert seed_cache.add(0, "Get lost, scammer.", {"cooperation": 0, "emotion": 0, "trust": 0}, 0)
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    agents = {"c": [a("Hi."), a("Hi again.")]}
    _, _, sim, out, _ = run(tok, scenario, tmp_path, agents, {"c": [("fresh", 0), ("fresh two", 0)]},
                            cache=cache_cfg, max_turns=2)
    turns = column(out, "turns")[0]
    assert [t["user_source"] for t in turns] == ["cache", "simulator"]
    assert turns[0]["user_reply"] == "A cached hello."
    assert turns[0]["user_state"] == {"cooperation": 2, "emotion": 2, "trust": 2}  # the profile's own state
    heard = sim.requests[0].messages[2]["content"]
    assert "A cached hello." in heard and "<user_emotion>2</user_emotion>" in heard
    assert "<user_trust>2</user_trust>" in heard and "<user_trust>3</user_trust>" not in heard
    assert all("Get lost" not in t["user_reply"] for t in turns)


def test_profiles_per_uid_group_from_controller_and_from_dataset(tok, scenario, tmp_path):
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    keys = ["g1", "g1", "g1", "g2", "g2", "g2"]
    policy = ProgrammedPolicy(tok, {"g1": [a("Hi.")], "g2": [a("Hi.")]})
    sim = ProgrammedSim(scenario, {"g1": [("ok", 1)], "g2": [("ok", 1)]})
    loop = LLMGenerationManager(tok, policy, base_config(tmp_path, controller={"enabled": True, "seed": 3}),
                                is_validation=False, client=sim)
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=keys))
    nt = record_columns(out)
    assert list(nt["dialogue_id"]) == ["g1#0", "g1#1", "g1#2", "g2#0", "g2#1", "g2#2"]
    assert len({json.dumps(p) for p in nt["profile"][:3]}) == 1 and len({json.dumps(p) for p in nt["profile"][3:]}) == 1
    for req in sim.requests:  # each dialogue's persona is its own row's profile
        i = list(nt["dialogue_id"]).index(req.dialogue_id)
        persona = scenario.render_user_prompt(UserProfile.from_dict(nt["profile"][i]))
        assert req.messages[0] == {"role": "system", "content": persona}
        assert nt["state_key"][i] == scenario.state_key(UserProfile.from_dict(nt["profile"][i]).state)
    # without the controller the dataset column decides, row by row
    profiles = [profile3(1, 0, 2), profile3(3, 3, 4)]
    loop = LLMGenerationManager(tok, policy, base_config(tmp_path), is_validation=True, client=sim)
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, ["g1", "g2"], profiles=profiles))
    assert list(column(out, "state_key")) == ["c1-e0-t2", "c3-e3-t4"]
    bad = make_gen_batch(tok, scenario, ["g1", "g2"])
    bad.non_tensor_batch["user_profile"][1] = "{not json"
    with pytest.raises(ValueError, match=r"user_profile'\]\[1\].*uid 'g2'.*JSON"):
        loop.run_llm_loop(bad)
    del bad.non_tensor_batch["user_profile"]
    with pytest.raises(ValueError, match="user_profile"):
        loop.run_llm_loop(bad)


def test_sampling_meta_reaches_the_worker_group_with_padding_to_world_size(tok, scenario, tmp_path):
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    agents = {k: [a("Hi.")] * 2 for k in ("k1", "k2", "k3")}
    sims = {"k1": [("ok", 0)] * 2, "k2": [("ok", 1)], "k3": [("ok", 0)] * 2}
    meta = {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    loop, policy, sim, out, _ = run(tok, scenario, tmp_path, agents, sims, validation=True, meta=meta, max_turns=2)
    assert len(policy.calls) == 2 and [c["rows"] for c in policy.calls] == [4, 2]  # 3 -> 4 rows, then 2 active
    for call in policy.calls:
        assert {k: call[k] for k in meta} == meta
        assert call["eos_token_id"] == tok.eos_token_id and call["pad_token_id"] == tok.pad_token_id
        assert call["response_length"] == 128
    assert len(out) == 3


def test_token_buffer_gather_matches_plain_python(tok):
    gen = torch.Generator().manual_seed(0)
    B, P, R, pad = 5, 7, 9, 0
    lens = [3, 7, 1, 5, 2]
    ids = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, P - n:] = torch.randint(1, 50, (n,), generator=gen)
        mask[i, P - n:] = 1
    buf = TokenBuffer(ids, mask, R, pad)
    extra = {0: [11, 12], 2: [13, 14, 15, 16], 3: [], 4: [17]}
    for r, toks in extra.items():
        buf.append_sampled(r, toks, 0)
    rows = [4, 0, 2, 3]
    got = buf.context_batch(rows)
    contexts = [ids[r, P - lens[r]:].tolist() + extra[r] for r in rows]
    W = max(map(len, contexts))
    for j, ctx in enumerate(contexts):
        assert got["input_ids"][j].tolist() == [pad] * (W - len(ctx)) + ctx
        assert got["attention_mask"][j].tolist() == [0] * (W - len(ctx)) + [1] * len(ctx)
        assert got["position_ids"][j].tolist() == [0] * (W - len(ctx)) + list(range(len(ctx)))
    with pytest.raises(ValueError, match="exceeds the response budget"):
        buf.append_context(1, list(range(R + 1)))
    right = mask.flip(1)
    with pytest.raises(ValueError, match="not left-padded"):
        TokenBuffer(ids, right, R, pad)


def test_hooks_log_metrics_and_state_roundtrip(tok, scenario, tmp_path):
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    agents = {"h1": [a("Hi.")] * 2, "h2": [a("Hi.")] * 2}
    sims = {"h1": [("ok", 1)], "h2": [FAIL]}
    policy, sim = ProgrammedPolicy(tok, agents), ProgrammedSim(scenario, sims)
    cfg = base_config(tmp_path, controller={"enabled": True})
    loop = LLMGenerationManager(tok, policy, cfg, is_validation=False, client=sim)
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, ["h1", "h2"]))
    metrics = loop.on_train_step_end(out, step=4)
    assert metrics["dialogue/completion_rate"] == 1.0 and metrics["dialogue/error_rate"] == 0.5
    assert metrics["controller/updates"] == 1.0 and metrics["controller/n"] == 1.0  # the error row is excluded
    lines = [json.loads(x) for x in (tmp_path / "logs" / "rollout.jsonl").read_text().splitlines()]
    assert [(x["step"], x["split"], x["outcome"]) for x in lines] == [(4, "train", "completed"), (4, "train", "error")]
    assert lines[0]["profile"] == column(out, "profile")[0] and lines[0]["reward"] is None
    state = json.loads(json.dumps(loop.state_dict()))
    fresh = LLMGenerationManager(tok, policy, cfg, is_validation=False, client=sim)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    val = LLMGenerationManager(tok, policy, base_config(tmp_path), is_validation=True, client=sim)
    batches = [val.run_llm_loop(make_gen_batch(tok, scenario, ["h1"])) for _ in range(2)]
    vm = val.on_validation_end(batches, step=4)
    assert vm["dialogue/n_dialogues"] == 2.0 and vm["dialogue/completion_rate"] == 1.0
    line = json.loads((tmp_path / "logs" / "val.jsonl").read_text())
    assert line["step"] == 4 and line["n_dialogues"] == 2 and line["metrics"]["completion_rate"] == 1.0
    with pytest.raises(ValueError, match="controller"):
        val.load_state_dict(state)
    loop.close()


@pytest.mark.parametrize("override, key", [
    ({"max_turn": 3}, "rollout_loop.config.max_turn is not a config key"),
    ({"max_turns": 0}, "rollout_loop.config.max_turns=0 is outside"),
    ({"max_tokens_per_turn": 300, "max_response_length": 200}, "rollout_loop.config.max_response_length"),
    ({"scenario": "nope/missing.yaml"}, "rollout_loop.config.scenario: file not found"),
    ({"user_sim": {"top_p": 0}}, "rollout_loop.config.user_sim.top_p"),
    ({"cache": {"bogus": 1}}, "rollout_loop.config.cache"),
])
def test_config_errors_name_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        GenerationConfig.from_dict(base_config(tmp_path, **override))


def test_missing_simulator_urls_is_a_config_error(tok, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout_loop\.config\.user_sim\.urls is required"):
        LLMGenerationManager(tok, ProgrammedPolicy(tok, {}), base_config(tmp_path), is_validation=True)


def _seeded_cache(scenario, tmp_path):
    """A cache config that always serves stage 0 once its file holds one reply (written here)."""
    cfg = {"enabled": True, "path": str(tmp_path / "flags.jsonl"), "stage_hit_rates": {0: 1.0}, "min_bucket_size": 1}
    assert UserResponseCache(CacheConfig.from_dict(cfg), scenario.name).add(
        0, "A cached hello.", {"cooperation": 2, "emotion": 2, "trust": 2}, 0)
    return cfg


def test_a_format_error_turn_between_two_cached_turns_is_not_a_cached_turn(tok, scenario, tmp_path):
    # "never two cached turns in a row" is about consecutive user turns: the format-error note is a turn
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    agents = {"f": [a("Hi."), "no reply tag at all", a("Third."), a("Fourth.")]}
    sims = {"f": [("s1", 0), ("s2", 0), ("s3", 0), ("s4", 0)]}
    _, _, sim, out, _ = run(tok, scenario, tmp_path, agents, sims, max_turns=4,
                            cache=_seeded_cache(scenario, tmp_path))
    sources = [t["user_source"] for t in column(out, "turns")[0]]
    assert sources == ["cache", "format_error", "cache", "simulator"]
    assert column(out, "cache_hits")[0] == 2 and sim.calls_for("f") == 1


def test_cache_flags_do_not_leak_from_a_failed_rollout_call(tok, scenario, tmp_path):
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    policy = ProgrammedPolicy(tok, {"u": [a("Hi.")]})  # no script for turn 2: the worker group raises there
    sim = ProgrammedSim(scenario, {"u": [("s1", 0), ("s2", 0)]})
    loop = LLMGenerationManager(tok, policy, base_config(tmp_path, max_turns=2,
                                                         cache=_seeded_cache(scenario, tmp_path)),
                                is_validation=False, client=sim)
    with pytest.raises(IndexError):
        loop.run_llm_loop(make_gen_batch(tok, scenario, ["u"]))
    policy.scripts["u"] = [a("Hi."), a("Again.")]
    out = loop.run_llm_loop(make_gen_batch(tok, scenario, ["u"]))  # same dialogue id "u#0" as the failed call
    assert [t["user_source"] for t in column(out, "turns")[0]] == ["cache", "simulator"]


def test_a_second_call_for_the_same_uids_keeps_their_sampled_profiles(tok, scenario, tmp_path):
    # the trainer's ReMax baseline runs the same uid groups twice in one step (greedy, then sampled): both
    # rollouts must talk to the same simulated user, or the baseline compares different users
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    keys = ["r1", "r1", "r2", "r2", "r3", "r3"]
    policy = ProgrammedPolicy(tok, {k: [a("Hi.")] for k in keys})
    sim = ProgrammedSim(scenario, {f"{k}{tail}": [("ok", 1)] for k in keys for tail in ("", "b")})
    cfg = base_config(tmp_path, controller={"enabled": True, "seed": 5, "min_behaviors": 3, "max_behaviors": 3})
    loop = LLMGenerationManager(tok, policy, cfg, is_validation=False, client=sim)
    first = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=keys))
    again = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=keys))
    assert list(column(again, "profile")) == list(column(first, "profile"))
    step2 = [f"{k}b" for k in keys]  # the next step's prompts: freshly sampled users
    fresh = loop.run_llm_loop(make_gen_batch(tok, scenario, keys, uids=step2))
    assert list(column(fresh, "profile")) != list(column(first, "profile"))


def test_validation_meets_the_same_simulated_users_at_every_step_and_training_does_not(tok, scenario, tmp_path):
    a = lambda reply: agent_text(scenario, reply)  # noqa: E731
    agents = {"x": [a("Hi."), a("Hi again.")], "y": [a("Hello."), a("Hello again.")]}
    uids = {step: [f"val{step}_0_0", f"val{step}_0_1"] for step in (1, 2)}  # the trainer tags uids with the step
    profiles = [profile3(1, 2, 3), profile3(2, 1, 1)]
    seeds = {}
    for validation in (True, False):
        sim = ProgrammedSim(scenario, {u: [("one", 0), ("two", 0)] for step in uids for u in uids[step]})
        loop = LLMGenerationManager(tok, ProgrammedPolicy(tok, agents), base_config(tmp_path, max_turns=2),
                                    validation, client=sim)
        for step in (1, 2):
            sim.requests.clear()
            loop.run_llm_loop(make_gen_batch(tok, scenario, list(agents), uids=uids[step], profiles=profiles))
            seeds[validation, step] = sorted(r.seed for r in sim.requests)
    assert seeds[True, 1] == seeds[True, 2] and len(set(seeds[True, 1])) == 4
    assert seeds[False, 1] != seeds[False, 2]
