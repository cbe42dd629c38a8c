"""The tiny model builder: deterministic, loadable with transformers, head_dim usable by vLLM on CPU."""
import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from utils.make_tiny_model import build_tiny_model

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_gives_identical_files(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    for name in ("model.safetensors", "tokenizer.json"):
        assert _digest(a / name) == _digest(b / name)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")


def test_loads_with_transformers_and_chats(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = model.config
    assert config.hidden_size // config.num_attention_heads >= 32
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<pad>"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello, who is calling?"}], add_generation_prompt=True, return_dict=False
    )
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_tag_tokens_make_each_agent_tag_one_token_and_round_trip(tmp_path):
    from utils.make_tiny_model import TinyModelSpec, scenario_tags

    tags = scenario_tags()
    assert "<response>" in tags and "</response>" in tags and "<stage>" in tags
    plain = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "plain", seed=0))
    tagged = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tagged", seed=0,
                                                            spec=TinyModelSpec(tag_tokens=True, hidden_size=128,
                                                                               num_attention_heads=4)))
    text = "<stage>2</stage>\n<response>Open the app, tap Boost.</response>\n<status>0</status>"
    ids = tagged(text, add_special_tokens=False)["input_ids"]
    assert tagged.decode(ids, skip_special_tokens=True) == text
    pieces = [tagged.decode([i]) for i in ids]
    for tag in ("<stage>", "</stage>", "<response>", "</response>", "<status>", "</status>"):
        assert pieces.count(tag) == 1, pieces
    assert len(ids) < len(plain(text, add_special_tokens=False)["input_ids"])
    assert "<stage>" not in [plain.decode([i]) for i in plain(text, add_special_tokens=False)["input_ids"]]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tagged")
    assert model.config.hidden_size == 128 and model.config.vocab_size == len(tagged)


def test_only_the_tokenizers_and_the_runs_own_scenarios_are_read(tmp_path):
    """A run's new scenario (a tag of its own) reaches its tokenizer's tags; a broken draft beside it is never read,
    and neither is a scenario shipped after the tokenizer's set was frozen (the support desk): shipping one changes
    no existing tiny model."""
    import yaml

    from llm_agent.scenario import DEFAULT_SCENARIO_PATH, SHIPPED_SCENARIO_PATHS, TOKENIZER_SCENARIO_PATHS, scenario_path
    from utils.make_tiny_model import scenario_corpus, scenario_files, scenario_tags

    data = yaml.safe_load(DEFAULT_SCENARIO_PATH.read_text(encoding="utf-8"))
    data["name"] = "pizza_trial"
    data["agent"]["tags"]["reply"]["tag"] = "say"
    data["behavior_library"] = str((DEFAULT_SCENARIO_PATH.parent / data["behavior_library"]).resolve())
    mine = tmp_path / "pizza_trial.yaml"
    mine.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    (tmp_path / "draft.yaml").write_text("name: [unfinished\n", encoding="utf-8")
    assert scenario_files() == sorted(p.resolve() for p in TOKENIZER_SCENARIO_PATHS)
    desk = scenario_path("support_desk")
    assert desk in SHIPPED_SCENARIO_PATHS and desk.resolve() not in scenario_files()
    assert desk.resolve() in scenario_files([desk])  # a run on it passes it, as a run's own
    assert scenario_files([mine]) == sorted([*scenario_files(), mine.resolve()])
    assert "<say>" not in scenario_tags() and {"<say>", "</say>"} <= set(scenario_tags([mine]))
    assert "  name: pizza_trial" not in scenario_corpus() and "name: pizza_trial" in scenario_corpus([mine])
