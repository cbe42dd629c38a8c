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


def test_only_the_tokenizers_and_the_runs_own_scenarios_tags_are_read(tmp_path):
    """A run's new scenario (a tag of its own) reaches its tokenizer's tags; a broken draft beside it is never read,
    and neither is a scenario shipped after the tokenizer's set was frozen (the support desk): shipping one changes
    no existing tiny model."""
    import yaml

    from llm_agent.scenario import (DEFAULT_SCENARIO_PATH, SHIPPED_SCENARIO_PATHS, TOKENIZER_SCENARIO_PATHS,
                                    scenario_path)
    from utils.make_tiny_model import scenario_files, scenario_tags

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


def _shipped_copies(where: Path, edit) -> list[Path]:
    """Copies of the tokenizer's scenarios in `where`, each passed through `edit(data)` (its YAML as a dict)."""
    import yaml

    from llm_agent.scenario import TOKENIZER_SCENARIO_PATHS

    where.mkdir()
    copies = []
    for path in TOKENIZER_SCENARIO_PATHS:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if "behavior_library" in data:
            data["behavior_library"] = str((path.parent / data["behavior_library"]).resolve())
        edit(data)
        copies.append(where / path.name)
        copies[-1].write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return copies


def test_editing_the_shipped_scenarios_wording_leaves_the_tiny_model_byte_identical(tmp_path, monkeypatch):
    """The vocabulary comes from the fixed corpus and the tag protocol only: a reworded description, compact
    prompt, fact and doubt line change no file of the model; a renamed tag changes the vocabulary."""
    import utils.make_tiny_model as tiny
    from utils.make_tiny_model import TinyModelSpec

    spec = TinyModelSpec(tag_tokens=True, hidden_size=128, num_attention_heads=4)
    shipped = build_tiny_model(tmp_path / "shipped", seed=0, spec=spec)

    def reword(data):
        data["description"] = "A completely different sentence about a pizza shop and its Wednesday specials."
        data["agent"]["compact_prompt"] = data["agent"]["compact_prompt"] + " Speak slowly and kindly."
        data["facts"][0] = "Zucchini quesadillas are jubilantly exquisite on Thursdays."
        categories = data["scripted"]["categories"]
        categories[next(iter(categories))]["doubt"][0] = "Hmm, whoever invented this xylophone scheme?"

    monkeypatch.setattr(tiny, "TOKENIZER_SCENARIO_PATHS", _shipped_copies(tmp_path / "reworded", reword))
    reworded = build_tiny_model(tmp_path / "reworded_model", seed=0, spec=spec)
    files = sorted(p.name for p in shipped.iterdir())
    assert files == sorted(p.name for p in reworded.iterdir()) and "tokenizer.json" in files
    for name in files:
        assert _digest(shipped / name) == _digest(reworded / name), name

    def rename_tag(data):
        data["agent"]["tags"]["reply"]["tag"] = "say"

    monkeypatch.setattr(tiny, "TOKENIZER_SCENARIO_PATHS", _shipped_copies(tmp_path / "renamed", rename_tag))
    renamed = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "renamed_model", seed=0, spec=spec))
    assert len(renamed.tokenize("<say>")) == 1 and len(AutoTokenizer.from_pretrained(shipped).tokenize("<say>")) > 1
