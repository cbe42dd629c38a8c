"""SFT warm start: assistant-only loss masks for several chat templates, the loss maths against float64, a
seeded fine-tune that learns its transcripts and saves a loadable model, and scripted transcripts played against
the scripted simulator."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_agent.scenario import DEFAULT_SCENARIO_PATH
from utils.sft_warm_start import (check_messages, encode_dialogue, parse_quality_mix, read_dialogues,
                                  scripted_dialogues, sft_on_dialogues)
from verl.trainer.fsdp_sft_trainer import assistant_nll, collate

REPO = Path(__file__).resolve().parents[2]
SCENARIO_PATH = DEFAULT_SCENARIO_PATH

DIALOGUE = [
    {"role": "system", "content": "You are Mia."},
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "<response>Hi, this is Mia.</response>"},
    {"role": "user", "content": "Who?"},
    {"role": "assistant", "content": "<response>Mia from FoodLoop.</response>"},
    {"role": "user", "content": "Okay."},
]
# "Name: text" lines; the assistant's header comes from the generation prompt and its turn ends with the EOS.
COLON_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}Agent: {{ m['content'] }}<|im_end|>\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Agent: {% endif %}"
)
# No generation prompt at all and no EOS: the header is part of the assistant rendering, which is not learned.
NO_PROMPT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
# Renders the last message differently, so an earlier rendering is no prefix of a later one.
NOT_PREFIX_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if loop.last %} (end){% endif %}\n"
                       "{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _learned_text(tokenizer, row) -> list[str]:
    """Decoded runs of consecutive mask-1 tokens."""
    runs, current = [], []
    for token, flag in zip(row.input_ids, row.loss_mask):
        if flag:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_chatml_mask_covers_exactly_assistant_content_and_eos(tokenizer):
    row = encode_dialogue(tokenizer, DIALOGUE)
    assert _learned_text(tokenizer, row) == [m["content"] + "<|im_end|>" for m in DIALOGUE if m["role"] == "assistant"]
    full = tokenizer.apply_chat_template(DIALOGUE, tokenize=False)
    assert tokenizer.decode(row.input_ids) == full
    # the policy's context before its first turn is exactly the chat template's generation prompt
    first = row.loss_mask.index(1)
    head = tokenizer.apply_chat_template(DIALOGUE[:2], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(row.input_ids[:first]) == head


@pytest.mark.parametrize("template, suffix", [(COLON_TEMPLATE, "<|im_end|>"), (NO_PROMPT_TEMPLATE, "")])
def test_mask_follows_other_templates(tokenizer, template, suffix):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = template
    row = encode_dialogue(tok, DIALOGUE)
    assert _learned_text(tok, row) == [m["content"] + suffix for m in DIALOGUE if m["role"] == "assistant"]
    assert tok.decode(row.input_ids) == tok.apply_chat_template(DIALOGUE, tokenize=False)


def test_template_that_is_not_incremental_is_rejected(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = NOT_PREFIX_TEMPLATE
    with pytest.raises(ValueError, match="extension of the messages before it"):
        encode_dialogue(tok, DIALOGUE)


def test_truncation_and_bad_transcripts(tokenizer):
    row = encode_dialogue(tokenizer, DIALOGUE, max_length=12)
    assert len(row.input_ids) == len(row.loss_mask) == 12
    with pytest.raises(ValueError, match="dialogue 3: message 1 needs a role"):
        check_messages([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], "dialogue 3")
    with pytest.raises(ValueError, match="no assistant message"):
        check_messages([{"role": "user", "content": "a"}], "x")
    with pytest.raises(ValueError, match="message 0 is an assistant turn"):
        check_messages([{"role": "assistant", "content": "a"}], "x")
    with pytest.raises(ValueError, match="exactly the keys"):
        check_messages([{"role": "user", "content": "a", "name": "n"}], "x")


def test_read_dialogues_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(DIALOGUE) + "\n\n" + json.dumps({"messages": DIALOGUE}) + "\n")
    assert read_dialogues(path) == [DIALOGUE, DIALOGUE]
    path.write_text(json.dumps(DIALOGUE) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not valid JSON"):
        read_dialogues(path)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:1: message 0"):
        read_dialogues(path)


def test_assistant_nll_matches_float64_reference(tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    rows = [encode_dialogue(tokenizer, DIALOGUE), encode_dialogue(tokenizer, DIALOGUE[:3])]
    batch = collate(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        loss, count = assistant_nll(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    total, n = 0.0, 0
    for b, row in enumerate(rows):
        for t in range(1, len(row.input_ids)):
            if not row.loss_mask[t]:
                continue
            values = logits[b, t - 1].tolist()
            top = max(values)
            log_z = top + math.log(sum(math.exp(v - top) for v in values))
            total += log_z - values[row.input_ids[t]]
            n += 1
    assert count == n == sum(sum(r.loss_mask[1:]) for r in rows)
    assert loss.item() == pytest.approx(total / n, rel=1e-5)


def _assistant_loss(model_dir, tokenizer, dialogues) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = collate([encode_dialogue(tokenizer, d) for d in dialogues], tokenizer.pad_token_id)
    with torch.no_grad():
        return assistant_nll(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])[0].item()


def test_sft_learns_the_assistant_turns_seeded_and_saves(tokenizer, tiny_model_path, tmp_path):
    dialogues = [DIALOGUE, DIALOGUE[:3], [*DIALOGUE[:4], {"role": "assistant", "content": "<response>Bye.</response>"}]]
    out_a = sft_on_dialogues(tiny_model_path, tmp_path / "a", dialogues, steps=30, lr=3e-3, batch_size=2, seed=1)
    out_b = sft_on_dialogues(tiny_model_path, tmp_path / "b", dialogues, steps=30, lr=3e-3, batch_size=2, seed=1)
    before = _assistant_loss(tiny_model_path, tokenizer, dialogues)
    after = _assistant_loss(out_a, tokenizer, dialogues)
    assert after < 0.5 * before, (before, after)
    log = json.loads((out_a / "sft_log.json").read_text())
    assert len(log["losses"]) == 30 and log["n_dialogues"] == 3 and log["losses"][-1] < log["losses"][0]
    assert (out_a / "tokenizer_config.json").is_file()
    from safetensors.torch import load_file

    wa, wb = load_file(str(out_a / "model.safetensors")), load_file(str(out_b / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "same seed, same weights"


def test_sft_rejects_bad_settings(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="need steps >= 1"):
        sft_on_dialogues(tiny_model_path, tmp_path / "x", [DIALOGUE], steps=0, lr=1e-3)
    with pytest.raises(ValueError, match="dialogue 1: message 0"):
        sft_on_dialogues(tiny_model_path, tmp_path / "x", [DIALOGUE, [{"role": "user"}]], steps=1, lr=1e-3)
    with pytest.raises(ValueError, match="no dialogue keeps an assistant token within max_length=3"):
        sft_on_dialogues(tiny_model_path, tmp_path / "x", [DIALOGUE], steps=1, lr=1e-3, max_length=3)


@pytest.mark.extended  # 26 s measured: make test-extended (CI), out of make test's 20 minutes
@pytest.mark.slow
def test_cli_trains_from_jsonl(tiny_model_path, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in (DIALOGUE, DIALOGUE[:3])) + "\n")
    proc = subprocess.run([sys.executable, "-m", "utils.sft_warm_start", "--model", tiny_model_path,
                           "--out", str(tmp_path / "out"), "--dialogues", str(data), "--steps", "3"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "out")
    assert len(json.loads((tmp_path / "out" / "sft_log.json").read_text())["losses"]) == 3
    bad = subprocess.run([sys.executable, "-m", "utils.sft_warm_start", "--model", tiny_model_path,
                          "--out", str(tmp_path / "o2"), "--dialogues", str(tmp_path / "missing.jsonl"),
                          "--steps", "3"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr
    scripted = subprocess.run([sys.executable, "-m", "utils.sft_warm_start", "--model", tiny_model_path,
                               "--out", str(tmp_path / "o3"), "--scenario", str(SCENARIO_PATH), "--n-dialogues", "4",
                               "--max-turns", "2", "--system-prompt", "Be brief.", "--steps", "2"],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    assert scripted.returncode == 0, scripted.stderr
    log = json.loads((tmp_path / "o3" / "sft_log.json").read_text())
    assert log["n_dialogues"] == 4 and len(log["losses"]) == 2
    mix = subprocess.run([sys.executable, "-m", "utils.sft_warm_start", "--model", tiny_model_path,
                          "--out", str(tmp_path / "o4"), "--scenario", str(SCENARIO_PATH), "--quality-mix", "good",
                          "--steps", "2"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert mix.returncode == 2 and "--quality-mix: 'good' is not name=weight" in mix.stderr


def test_parse_quality_mix():
    assert parse_quality_mix("good=0.4, bad=0.1,malformed=0.5") == {"good": 0.4, "bad": 0.1, "malformed": 0.5}
    for bad in ("good=x", "=1", "good"):
        with pytest.raises(ValueError, match="is not name=weight"):
            parse_quality_mix(bad)


def test_scripted_dialogues_are_the_agent_side_of_scripted_calls(tokenizer):
    from llm_agent.scenario import load_scenario

    scenario = load_scenario(SCENARIO_PATH)
    mix = {"good": 0.5, "bad": 0.25, "malformed": 0.25}
    calls = scripted_dialogues(SCENARIO_PATH, 16, mix, seed=3, max_turns=10, system_prompt="Be brief.")
    assert len(calls) == 16
    assert calls == scripted_dialogues(SCENARIO_PATH, 16, mix, seed=3, max_turns=10, system_prompt="Be brief.")
    assert calls != scripted_dialogues(SCENARIO_PATH, 16, mix, seed=4, max_turns=10, system_prompt="Be brief.")
    lines = scenario.scripted.lines
    ends = {"completed": 0, "hung_up": 0, "malformed": 0}
    for call in calls:
        assert call[0] == {"role": "system", "content": "Be brief."}
        assert call[1] == {"role": "user", "content": scenario.agent_opening}
        assert [m["role"] for m in call[2:]] == ["assistant", "user"] * ((len(call) - 2) // 2) + \
            ["assistant"] * (len(call) % 2)
        agent_turns = [scenario.parse_agent_output(m["content"]) for m in call if m["role"] == "assistant"]
        assert all(not t.parse_error for t in agent_turns[:-1]), "a call ends at its first untagged turn"
        assert all("<" not in m["content"] for m in call[2:] if m["role"] == "user"), "users speak, no tags"
        if agent_turns[-1].parse_error:
            ends["malformed"] += 1
            assert call[-1]["role"] == "assistant"
        elif call[-1]["content"] in lines["completed"]:
            ends["completed"] += 1
        elif call[-1]["content"] in lines["hang_up"]:
            ends["hung_up"] += 1
        assert sum(encode_dialogue(tokenizer, call).loss_mask) > 0
    assert all(count > 0 for count in ends.values()), ends


def test_scripted_dialogues_take_any_agent_and_check_their_settings():
    from llm_agent.scenario import load_scenario

    scenario = load_scenario(SCENARIO_PATH)
    asked = []

    def polite_goodbye(quality, seed):
        asked.append(quality)
        return lambda messages: scenario.format_agent_output("Thanks for your time, goodbye.", 0, 0, {})

    calls = scripted_dialogues(SCENARIO_PATH, 5, {"polite": 1.0}, seed=0, agent_factory=polite_goodbye)
    assert asked == ["polite"] * 5
    for call in calls:  # saying goodbye before the task is done makes the scripted user hang up
        assert len(call) == 4 and call[-1]["content"] in scenario.scripted.lines["hang_up"]
    with pytest.raises(ValueError, match="quality_mix must map"):
        scripted_dialogues(SCENARIO_PATH, 2, {}, seed=0)
    with pytest.raises(ValueError, match="quality_mix must map"):
        scripted_dialogues(SCENARIO_PATH, 2, {"good": -1.0, "bad": 2.0}, seed=0)
    with pytest.raises(ValueError, match="need n >= 1"):
        scripted_dialogues(SCENARIO_PATH, 0, {"good": 1.0}, seed=0)
    with pytest.raises(ValueError, match="quality must be one of"):
        scripted_dialogues(SCENARIO_PATH, 1, {"superb": 1.0}, seed=0)
