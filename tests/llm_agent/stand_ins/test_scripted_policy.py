"""The scripted worker-group stand-in and the in-process simulator the rollout loop's tests are built on.

Checks that `ScriptedPolicyWorkerGroup.generate_sequences` has the real HFRollout's output contract (compared
with the tiny model's actual HFRollout), and that its "good" agent completes most calls against the scripted
user while "bad", "malformed" and "ender" fail in their own ways, driving a multi-turn chat by hand.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, SCENARIO_DIR, UserProfile, load_scenario, sample_behaviors
from llm_agent.stand_ins.scripted_policy import ScriptedAgent, ScriptedPolicyWorkerGroup, too_similar
from llm_agent.user_sim.client import TurnReply, TurnRequest, TurnFailure
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.hf_rollout import HFRollout
from tests.helpers.profiles import STATUS_COMPLETED, STATUS_CONTINUE, STATUS_ENDED

REPO_ROOT = Path(__file__).resolve().parents[3]
SCENARIO_FILES = sorted(SCENARIO_DIR.glob("*.yaml"))
OUTBOUND = load_scenario(DEFAULT_SCENARIO_PATH)
KEYS = {"prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")


def encode(tokenizer, chats: list[list[dict]], response_length: int = 256, **meta) -> DataProto:
    """Left-padded prompt batch of the chats (generation prompt appended), as the rollout loop sends it."""
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tensors = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
               "position_ids": compute_position_id_with_mask(enc["attention_mask"])}
    meta_info = {"response_length": response_length, "eos_token_id": tokenizer.eos_token_id,
                 "pad_token_id": tokenizer.pad_token_id, **meta}
    return DataProto.from_dict(tensors, meta_info=meta_info)


def opening(scenario) -> list[dict]:
    return [{"role": "system", "content": scenario.render_agent_prompt()},
            {"role": "user", "content": scenario.agent_opening}]


def profiles(scenario, n: int) -> list[UserProfile]:
    out = []
    for seed in range(n):
        rng = random.Random(seed)
        out.append(scenario.profile(rng.choice(scenario.state_space()), sample_behaviors(scenario.behaviors, rng)))
    return out


def play(tokenizer, scenario, quality: str, n: int = 40, max_turns: int = 14, world_size: int = 2):
    """Drive n calls turn by turn: agent turns from the worker group, user turns from InProcessUserSim."""
    wg = ScriptedPolicyWorkerGroup(tokenizer, scenario, world_size=world_size, quality=quality, seed=0)
    sim = InProcessUserSim(scenario, seed=0)
    users = profiles(scenario, n)
    chats = [opening(scenario) for _ in range(n)]
    dialogues: list[list] = [[] for _ in range(n)]
    status = [STATUS_CONTINUE] * n
    for _ in range(max_turns):
        active = [i for i in range(n) if status[i] == STATUS_CONTINUE]
        if not active:
            break
        rows = active + active[: (-len(active)) % world_size]  # pad to a multiple of world_size
        out = wg.generate_sequences(encode(tokenizer, [chats[i] for i in rows]))
        requests = []
        for k, i in enumerate(active):
            kept = out.batch["responses"][k][out.batch["response_mask"][k].bool()].tolist()
            assert kept == wg.calls[-1][k] and kept[-1] == tokenizer.eos_token_id
            text = tokenizer.decode(kept[:-1])
            turn = scenario.parse_agent_output(text)
            dialogues[i].append(turn)
            chats[i].append({"role": "assistant", "content": text})
            if turn.status in (STATUS_COMPLETED, STATUS_ENDED):
                status[i] = 2  # the agent ended the call
                continue
            requests.append(TurnRequest(f"d{i}", scenario.render_user_messages(users[i], dialogues[i]), seed=i))
        for reply in sim.complete(requests):
            i = int(reply.dialogue_id[1:])
            user = scenario.parse_user_output(reply.text)
            assert user.well_formed, user.raw
            dialogues[i].append(user)
            chats[i].append({"role": "user", "content": user.reply})
            status[i] = user.status
    return status, dialogues


def test_output_has_the_real_hf_rollouts_keys_shapes_and_prompt_part(tokenizer, tiny_model_path):
    chats = [opening(OUTBOUND), opening(OUTBOUND)[:1] + [{"role": "user", "content": "Hi"}]]
    prompts = encode(tokenizer, chats, response_length=12, do_sample=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    real = HFRollout(model, OmegaConf.create({"response_length": 12})).generate_sequences(prompts)
    fake = ScriptedPolicyWorkerGroup(tokenizer, OUTBOUND).generate_sequences(prompts)
    assert set(fake.batch.keys()) == set(real.batch.keys()) == KEYS
    for key in KEYS:
        assert fake.batch[key].shape == real.batch[key].shape, key
        assert fake.batch[key].dtype == real.batch[key].dtype, key
    assert torch.equal(fake.batch["prompts"], real.batch["prompts"])
    P = prompts.batch["input_ids"].shape[1]
    for out in (real, fake):
        assert torch.equal(out.batch["position_ids"][:, :P], prompts.batch["position_ids"])
        assert torch.equal(out.batch["attention_mask"][:, :P], prompts.batch["attention_mask"])


def test_masks_positions_and_padding_follow_the_hf_rollout_rules(tokenizer):
    wg = ScriptedPolicyWorkerGroup(tokenizer, OUTBOUND, world_size=2)
    who = OUTBOUND.scripted.lines["ask_who"][0]
    chats = [opening(OUTBOUND), opening(OUTBOUND) + [{"role": "assistant", "content": "x"},
                                                     {"role": "user", "content": who}]]
    prompts = encode(tokenizer, chats, response_length=300)
    out = wg.generate_sequences(prompts).batch
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    P = prompts.batch["input_ids"].shape[1]
    for row in range(2):
        responses, mask = out["responses"][row].tolist(), out["response_mask"][row].tolist()
        end = responses.index(eos)
        assert mask == [1] * (end + 1) + [0] * (300 - end - 1), "1 up to and including the EOS"
        assert responses[end + 1:] == [pad] * (300 - end - 1)
        assert wg.calls[0][row] == responses[: end + 1]
        last = int(prompts.batch["position_ids"][row, -1])
        assert out["position_ids"][row, P:].tolist() == list(range(last + 1, last + 301))
        assert out["attention_mask"][row, P:].tolist() == mask
        assert out["input_ids"][row].tolist() == prompts.batch["input_ids"][row].tolist() + responses
        turn = OUTBOUND.parse_agent_output(tokenizer.decode(responses[:end]))
        assert turn.well_formed and turn.status == 0 and turn.stage == 0, "an introduction, also after 'who?'"


def test_a_long_turn_is_cut_at_response_length_without_eos(tokenizer):
    wg = ScriptedPolicyWorkerGroup(tokenizer, OUTBOUND, world_size=1)
    out = wg.generate_sequences(encode(tokenizer, [opening(OUTBOUND)], response_length=10)).batch
    assert out["responses"].shape == (1, 10)
    assert out["response_mask"].tolist() == [[1] * 10]
    assert tokenizer.eos_token_id not in out["responses"][0].tolist()
    assert wg.calls == [[out["responses"][0].tolist()]]


def test_bad_batches_are_refused_with_a_clear_error(tokenizer):
    wg = ScriptedPolicyWorkerGroup(tokenizer, OUTBOUND, world_size=2)
    with pytest.raises(ValueError, match="3 rows are not divisible by world_size=2"):
        wg.generate_sequences(encode(tokenizer, [opening(OUTBOUND)] * 3))
    with pytest.raises(ValueError, match="response_length"):
        wg.generate_sequences(encode(tokenizer, [opening(OUTBOUND)] * 2, response_length=0))
    right = encode(tokenizer, [opening(OUTBOUND), opening(OUTBOUND)[:1] + [{"role": "user", "content": "Hi"}]])
    right.batch["attention_mask"] = right.batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="left-padded"):
        wg.generate_sequences(right)
    with pytest.raises(ValueError, match="quality"):
        ScriptedPolicyWorkerGroup(tokenizer, OUTBOUND, quality="great")
    assert wg.calls == []


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=[p.stem for p in SCENARIO_FILES])
def test_good_agent_completes_most_calls_and_bad_agent_few(tokenizer, path):
    scenario = load_scenario(path)
    spec = scenario.scripted
    good_status, good_dialogues = play(tokenizer, scenario, "good")
    bad_status, _ = play(tokenizer, scenario, "bad")
    assert good_status.count(STATUS_COMPLETED) >= 32, good_status
    assert bad_status.count(STATUS_COMPLETED) <= 4, bad_status
    for dialogue in good_dialogues:
        said = [t.reply for t in dialogue[0::2]]
        for turn in dialogue[0::2]:
            assert turn.well_formed and turn.status == STATUS_CONTINUE, turn
            assert len(turn.reply.split()) < spec.rules.max_words
        for k, text in enumerate(said):
            assert not any(too_similar(text, earlier, 0.9) for earlier in said[:k]), said
        for user in dialogue[1::2]:
            assert user.think or scenario.user_tags.tag("think") is None, "the events are readable when tagged"
            assert not {"repetition", "overloaded", "pushy", "robotic"} & set(re.findall(r"\w+", user.think or ""))


def test_malformed_agent_writes_no_reply_tag_and_ender_ends_at_once(tokenizer):
    _, malformed = play(tokenizer, OUTBOUND, "malformed", n=4, max_turns=2)
    assert all(d[0].parse_error and d[0].reply is None and "missing:reply" in d[0].flags for d in malformed)
    status, ender = play(tokenizer, OUTBOUND, "ender", n=4, max_turns=3)
    assert status == [2] * 4 and all(len(d) == 1 and d[0].status == STATUS_COMPLETED for d in ender)


def test_instant_policy_returns_a_fixed_turn_per_stage_without_reading_words(tokenizer):
    wg = ScriptedPolicyWorkerGroup(tokenizer, OUTBOUND, world_size=2, instant=True)
    short, long_ = opening(OUTBOUND), opening(OUTBOUND) + [{"role": "assistant", "content": "a"},
                                                           {"role": "user", "content": "b"}]
    out = wg.generate_sequences(encode(tokenizer, [short, long_, short, long_])).batch
    turns = [OUTBOUND.parse_agent_output(tokenizer.decode(ids[:-1])) for ids in wg.calls[0]]
    assert all(t.well_formed and t.status == STATUS_CONTINUE for t in turns)
    assert wg.calls[0][0] == wg.calls[0][2] and wg.calls[0][1] == wg.calls[0][3]
    assert turns[0].stage != turns[1].stage, "one more finished turn moves to the next stage"
    assert out["response_mask"].sum(1).tolist() == [len(ids) for ids in wg.calls[0]]


def test_in_process_simulator_answers_fails_injected_ids_and_never_ends_on_request():
    profile = profiles(OUTBOUND, 1)[0]
    agent = OUTBOUND.parse_agent_output(OUTBOUND.format_agent_output("Hello, my name is Mia from FoodLoop.", 0, 0, {}))
    messages = OUTBOUND.render_user_messages(profile, [agent])
    sim = InProcessUserSim(OUTBOUND, fail_ids={"bad"})
    ok, failed = sim.complete([TurnRequest("good", messages, seed=1), TurnRequest("bad", messages)])
    assert isinstance(ok, TurnReply) and OUTBOUND.parse_user_output(ok.text).well_formed
    assert isinstance(failed, TurnFailure) and "injected" in failed.reason
    assert sim.stats() == {"user_sim/turns": 2.0, "user_sim/turn_failures": 1.0}
    sim.close()
    with pytest.raises(RuntimeError, match="after close"):
        sim.complete([TurnRequest("good", messages)])
    endless = InProcessUserSim(OUTBOUND, never_end=True)
    replies = endless.complete([TurnRequest(f"d{i}", messages) for i in range(50)])
    parsed = [OUTBOUND.parse_user_output(r.text) for r in replies]
    assert all(p.well_formed and p.status == STATUS_CONTINUE for p in parsed)
    assert len({p.raw for p in parsed}) >= 20, "varied replies, so a deduplicating cache can fill"
    assert [r.text for r in endless.complete([TurnRequest("d3", messages)])] == [replies[3].text]


def test_evasive_agent_answers_only_the_first_third_of_the_doubt_categories(tokenizer):
    categories = list(OUTBOUND.scripted.categories)
    known = set(categories[: len(categories) // 3])
    agent = ScriptedAgent(OUTBOUND, quality="evasive", seed=0)
    good = ScriptedAgent(OUTBOUND, quality="good", seed=0)
    opening_turn = OUTBOUND.agent_opening
    for category, script in OUTBOUND.scripted.categories.items():
        doubt = script.doubt[0]
        history = [("user", opening_turn), ("assistant", good.respond([("user", opening_turn)])),
                   ("user", f"Yes, I run the place. Go on. {doubt}")]
        answer = OUTBOUND.parse_agent_output(agent.respond(history))
        assert answer.well_formed and answer.status == STATUS_CONTINUE
        if category in known:
            assert any(a in answer.reply for a in good.lines.answers[category]), answer.reply
        else:
            assert not any(a in answer.reply for a in good.lines.answers[category]), answer.reply
    status, _ = play(tokenizer, OUTBOUND, "evasive", n=40)
    good_status, _ = play(tokenizer, OUTBOUND, "good", n=40)
    assert status.count(STATUS_COMPLETED) < good_status.count(STATUS_COMPLETED) - 15, (status, good_status)


def test_wrong_answer_agent_answers_every_doubt_with_another_categorys_answer(tokenizer):
    categories = list(OUTBOUND.scripted.categories)
    agent = ScriptedAgent(OUTBOUND, quality="wrong_answer", seed=0)
    good = ScriptedAgent(OUTBOUND, quality="good", seed=0)
    opening_turn = OUTBOUND.agent_opening
    for category, script in OUTBOUND.scripted.categories.items():
        history = [("user", opening_turn), ("assistant", good.respond([("user", opening_turn)])),
                   ("user", f"Yes, I run the place. Go on. {script.doubt[0]}")]
        answer = OUTBOUND.parse_agent_output(agent.respond(history))
        assert answer.well_formed and answer.status == STATUS_CONTINUE
        # shaped like an answer: one of another category's answer sentences, and none that settles the asked doubt
        others = {a for c in categories if c != category for a in good.lines.answers[c]}
        assert any(a in answer.reply for a in others), answer.reply
        assert not script.resolve.matches(answer.reply), (category, answer.reply)
    status, _ = play(tokenizer, OUTBOUND, "wrong_answer", n=40)
    good_status, _ = play(tokenizer, OUTBOUND, "good", n=40)
    assert status.count(STATUS_COMPLETED) < good_status.count(STATUS_COMPLETED) - 15, (status, good_status)
