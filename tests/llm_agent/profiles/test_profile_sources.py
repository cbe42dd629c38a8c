"""Where the writer's weights come from, and profile files of the writer as prompt data."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llm_agent.profiles.sources import load_weights
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, UserProfile, load_scenario
from utils.create_prompt_data import create_prompt_data
from tests.helpers.profiles import profile3

REPO = Path(__file__).resolve().parents[3]
SCENARIO_PATH = DEFAULT_SCENARIO_PATH
WEIGHTS = {"cooperation": {"1": 0.2, "2": 0.3, "3": 0.5}, "emotion": {"1": 0.6, "2": 0.4},
           "trust": {"1": 0.1, "2": 0.2, "3": 0.3, "4": 0.4}}


def test_weights_from_an_analysis_a_checkpoint_or_a_plain_mapping(tmp_path):
    analysis = tmp_path / "mistakes.json"
    analysis.write_text(json.dumps({"splits": {"train": {"recommended_weights": {"weights": WEIGHTS}},
                                               "val": {"recommended_weights": {"weights": {}}}}}))
    assert load_weights(analysis) == WEIGHTS
    ckpt = tmp_path / "global_step_3"
    ckpt.mkdir()
    labels = {g: list(w) for g, w in WEIGHTS.items()}
    (ckpt / "trainer_state.json").write_text(json.dumps({"rollout_loop": {"controller": {
        "labels": labels, "weights": {g: list(w.values()) for g, w in WEIGHTS.items()}}}}))
    assert load_weights(ckpt) == WEIGHTS
    plain = tmp_path / "w.json"
    plain.write_text(json.dumps(WEIGHTS))
    assert load_weights(plain) == WEIGHTS


def test_weight_files_without_weights_are_named(tmp_path):
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"splits": {"a": {}, "b": {}}}))
    with pytest.raises(ValueError, match=r"two\.json: choose the analysis split.*\['a', 'b'\]"):
        load_weights(two)
    off = tmp_path / "trainer_state.json"
    off.write_text(json.dumps({"rollout_loop": {"controller": None}}))
    with pytest.raises(ValueError, match="no state-controller weights"):
        load_weights(off)
    with pytest.raises(ValueError, match="cannot read sampling weights"):
        load_weights(tmp_path / "missing.json")


def test_writer_rows_are_prompt_data(tmp_path):
    scenario = load_scenario(SCENARIO_PATH)
    profiles = [profile3(1 + i % 3, 1, 2, (scenario.behaviors[i],)) for i in range(5)]
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(json.dumps({"index": i, "source": "rule", "attempts": 0, "repairs": [],
                                        "profile": p.to_dict()}) + "\n" for i, p in enumerate(profiles)))
    paths = create_prompt_data(SCENARIO_PATH, tmp_path / "data", 3, 2, profiles_file=path)
    rows = pq.read_table(paths["train"]).to_pylist() + pq.read_table(paths["test"]).to_pylist()
    assert [UserProfile.from_dict(json.loads(r["user_profile"])) for r in rows] == profiles
