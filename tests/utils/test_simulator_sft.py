"""The simulator's fine-tuning: examples are the client's requests and the simulator's replies, the report card's
checks filter them, shared sequences carry the same loss as one sequence per request, and the exported model
loads and answers through the simulator server's hf backend."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_agent.scenario import load_scenario

from tests.helpers.repo import REPO, SCENARIO_PATH
from tests.helpers.sim_servers import SimServers
from utils.make_tiny_model import TinyModelSpec
from utils.sft_warm_start import encode_dialogue
from utils.simulator_sft import (QUICK_RECIPE, SimulatorExample, TinyRecipe, canonical, encode_examples,
                                 filter_examples, logged_examples, parse_args, scripted_examples, tiny_fingerprint,
                                 tiny_simulator, weigh_numbers)
from verl.trainer.fsdp_sft_trainer import SFTConfig, collate, masked_nll_sum


@pytest.fixture(scope="module")
def examples(scenario):
    return scripted_examples(scenario, 3, {"good": 1.0}, seed=4, max_turns=4)


def test_scripted_examples_are_requests_and_the_personas_replies(scenario, examples):
    assert len({e.group for e in examples}) == 3
    for e in examples:
        assert e.messages[0]["role"] == "system" and e.messages[-1]["role"] == "user"
        assert scenario.recover_profile(e.messages[0]["content"])  # the rendered persona
        user = scenario.parse_user_output(e.reply)
        assert not user.parse_error and user.think  # as written: the think tag is kept
    kept, dropped = filter_examples(examples, scenario)
    assert kept == examples and not dropped


def test_the_filter_drops_what_fails_the_report_cards_checks(scenario, examples):
    first = examples[0]  # an introduction: trust +1 (the persona's reply says so)
    user = scenario.parse_user_output(first.reply)

    def variant(**state):
        return SimulatorExample("g", first.messages, scenario.format_user_output(
            user.reply, {**user.state, **state}, user.status))

    bad = [SimulatorExample("g", first.messages, "no tags"),
           variant(trust=user.state["trust"] + 3) if user.state["trust"] <= 2 else variant(trust=0),
           variant(trust=user.state["trust"] - 1 - 1)]
    kept, dropped = filter_examples([first, *bad], scenario)
    assert kept == [first]
    assert dropped == Counter({"not_format_valid": 1, "jump_over_limit": 1, "against_agent_turn": 1})


def test_shared_sequences_carry_the_same_loss_as_one_sequence_per_request(tiny_model_path, scenario, examples):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    flat = [SimulatorExample(e.group, e.messages, canonical(scenario, e.reply)) for e in examples]
    packed, too_long = encode_examples(tok, flat, max_length=100_000)
    assert too_long == 0 and len(packed) == 3  # one sequence per call
    single = [encode_dialogue(tok, e.messages + [{"role": "assistant", "content": e.reply}], loss_on="last")
              for e in flat]

    def total(rows):
        with torch.no_grad():
            batch = collate(rows, tok.pad_token_id)
            return sum(float(masked_nll_sum(model, batch["input_ids"][i:i + 1], batch["attention_mask"][i:i + 1],
                                            batch["loss_mask"][i:i + 1])[0]) for i in range(len(rows)))

    assert sum(sum(r.loss_mask) for r in packed) == sum(sum(r.loss_mask) for r in single)
    assert total(packed) == pytest.approx(total(single), rel=1e-4)
    # the loss covers exactly the reply and the end-of-turn token
    row = single[0]
    learned = tok.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])
    assert learned == flat[0].reply + tok.eos_token
    # raw replies (think tag kept) are not what the next request shows: one sequence per request
    raw, _ = encode_examples(tok, examples, max_length=100_000)
    assert len(raw) == len(examples)
    # too long alone: dropped and counted
    assert encode_examples(tok, flat[:1], max_length=50) == ([], 1)


def test_a_dropped_reply_stays_in_the_history_without_loss(tiny_model_path, scenario, examples):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    group = [SimulatorExample(e.group, e.messages, canonical(scenario, e.reply)) for e in examples
             if e.group == examples[0].group]
    assert len(group) >= 3
    rows, _ = encode_examples(tok, [group[0], group[2]], max_length=100_000)
    assert len(rows) == 1
    masked_text = tok.decode([t for t, m in zip(rows[0].input_ids, rows[0].loss_mask) if m])
    assert masked_text == group[0].reply + tok.eos_token + group[2].reply + tok.eos_token


def test_number_weight_weighs_the_state_and_status_values_only(tiny_model_path, scenario, examples):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    example = SimulatorExample("g", examples[0].messages, canonical(scenario, examples[0].reply))
    (row,), _ = encode_examples(tok, [example], max_length=100_000)
    (weighted,) = weigh_numbers(tok, [row], 5.0)
    heavy = "".join(tok.decode([t]) for t, w in zip(weighted.input_ids, weighted.loss_mask) if w == 5.0)
    user = scenario.parse_user_output(example.reply)
    assert heavy == "".join(str(v) for v in (*user.state.values(), user.status))  # the four values, in order
    assert [w for w in weighted.loss_mask if w not in (0, 5.0)] == [1] * (sum(row.loss_mask) - len(heavy.replace("-", "")))
    assert weigh_numbers(tok, [row], 1.0) == [row]
    with pytest.raises(ValueError, match="number_weight"):
        weigh_numbers(tok, [row], 0.0)


def test_logged_examples_are_the_simulator_turns_of_a_log(scenario, examples, tmp_path):
    profile = scenario.recover_profile(examples[0].messages[0]["content"])
    agent = scenario.format_agent_output("Hello, this is Mia from FoodLoop.", 0, 0,
                                         {"cooperation": 2, "emotion": 2, "trust": 2})
    turns = [{"agent_text": agent, "agent_status": 0, "user_reply": "Who?", "user_status": 0, "user_source": "simulator",
              "user_state": {"cooperation": 1, "emotion": 1, "trust": 1}, "user_error": None},
             {"agent_text": agent, "agent_status": 0, "user_reply": "Hm.", "user_status": 0, "user_source": "cache",
              "user_state": {"cooperation": 1, "emotion": 1, "trust": 1}, "user_error": None}]
    line = {"step": 1, "split": "train", "dialogue_id": "u#0", "profile": profile.to_dict(), "outcome": "timeout",
            "turns": turns, "sim_retries": 0}
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({**line, "split": split}) + "\n" for split in ("train", "val", "val@scripted")))
    got = logged_examples([path], scenario, splits=["train"])
    assert len(got) == 1  # the cached turn is history only
    assert got[0].messages == scenario.render_user_messages(profile, [scenario.parse_agent_output(agent)])
    assert scenario.parse_user_output(got[0].reply).state == {"cooperation": 1, "emotion": 1, "trust": 1}
    assert len(logged_examples([path], scenario)) == 3
    both = logged_examples([path], scenario, splits=["train", "val@scripted"])  # a judge's replies with training's
    assert [e.group for e in both] == [f"{path}#0", f"{path}#1"] and [e.reply for e in both] == [got[0].reply] * 2


def test_tiny_fingerprint_follows_the_recipe(tmp_path):
    recipe = TinyRecipe()
    assert tiny_fingerprint(recipe, SCENARIO_PATH) == tiny_fingerprint(TinyRecipe(), SCENARIO_PATH)
    assert tiny_fingerprint(recipe, SCENARIO_PATH) != tiny_fingerprint(TinyRecipe(n_calls=7), SCENARIO_PATH)
    other = tmp_path / "other.yaml"
    other.write_text(SCENARIO_PATH.read_text().replace("credit_amount: 300", "credit_amount: 400"))
    (tmp_path / "client_action.jsonl").write_text((REPO / "assets/client_action.jsonl").read_text())
    other.write_text(other.read_text().replace("../../../../assets/client_action.jsonl", "client_action.jsonl"))
    assert tiny_fingerprint(recipe, other) != tiny_fingerprint(recipe, SCENARIO_PATH)
    assert tiny_fingerprint(QUICK_RECIPE, SCENARIO_PATH) != tiny_fingerprint(recipe, SCENARIO_PATH)
    assert [parse_args(["--out", "x", *a]).tiny for a in ([], ["--tiny"], ["--tiny", "quick"])] == [None, "full",
                                                                                                  "quick"]
    assert parse_args(["--out", "x", "--split", "val", "val@scripted"]).split == ["val", "val@scripted"]


@pytest.mark.extended  # 29 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_cli_exports_a_model_the_hf_backend_serves_and_the_tiny_simulator_is_reused(tiny_model_path, tmp_path):
    out = tmp_path / "sim"
    proc = subprocess.run([sys.executable, "-m", "utils.simulator_sft", "--model", tiny_model_path, "--out", str(out),
                           "--scripted", "3", "--max-turns", "3", "--reply-format", "canonical", "--steps", "2",
                           "--lr", "1e-3", "--batch-size", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads((out / "simulator_sft.json").read_text())
    assert info["rows"] == 3 and info["kept"] == info["examples"] and info["reply_format"] == "canonical"
    assert json.loads((out / "sft_log.json").read_text())["steps"] == 2
    AutoModelForCausalLM.from_pretrained(out)
    bad = subprocess.run([sys.executable, "-m", "utils.simulator_sft", "--model", tiny_model_path, "--out",
                          str(tmp_path / "x"), "--steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--rollouts and/or --scripted" in bad.stderr

    scenario = load_scenario(SCENARIO_PATH)
    request = scripted_examples(scenario, 1, {"good": 1.0}, seed=9, max_turns=1)[0].messages
    servers = SimServers(tmp_path)
    url = servers.start("--backend", "hf", "--model", str(out))
    try:
        servers.wait_ready(url, timeout_s=120)
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "user-sim", "messages": request,
                                                                 "max_tokens": 16, "seed": 1}, timeout=60)
        assert answer.status_code == 200 and isinstance(answer.json()["choices"][0]["message"]["content"], str)
    finally:
        servers.stop_all()

    recipe = TinyRecipe(spec=TinyModelSpec(), n_calls=2, max_turns=2, sft=SFTConfig(steps=2, lr=1e-3, batch_size=2))
    made = tiny_simulator(tmp_path / "tiny", SCENARIO_PATH, recipe)
    stamp = (made / "model.safetensors").stat().st_mtime_ns
    again = tiny_simulator(tmp_path / "tiny", SCENARIO_PATH, recipe)
    assert again == made and (made / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not made again
    assert json.loads((made / "simulator_sft.json").read_text())["fingerprint"] == tiny_fingerprint(recipe,
                                                                                                    SCENARIO_PATH)


def test_the_help_names_no_model_directory_it_does_not_show_how_to_make():
    # the help once told users to fine-tune `--model outputs/tiny_sim_base`, a directory nothing makes
    import re

    import utils.simulator_sft as module

    text = "\n".join(line for line in module.__doc__.splitlines() if line.startswith("    "))  # the usage lines
    assert "--model" in text
    for model in re.findall(r"--model (\S+)", text):
        if not model.startswith("/"):  # /models/...: the user's own
            made = text.index(f"--out {model}") if f"--out {model}" in text else -1
            assert 0 <= made < text.index(f"--model {model}"), f"{model} is made by no earlier command of the help"
