"""utils/create_prompt_data.py: parquet rows a trainer can load, fixed seeded test profiles, clear errors."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH, UserProfile, load_scenario
from utils.create_prompt_data import create_prompt_data, main, valid_states
from tests.helpers.profiles import profile3

REPO = Path(__file__).resolve().parents[2]
SCENARIO_PATH = DEFAULT_SCENARIO_PATH
SCENARIO = load_scenario(SCENARIO_PATH)


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_rows_hold_the_agent_prompt_and_in_range_profiles_without_extremes(tmp_path):
    paths = create_prompt_data(SCENARIO_PATH, tmp_path, train_samples=40, test_samples=10, seed=3)
    train, test = _rows(paths["train"]), _rows(paths["test"])
    assert len(train) == 40 and len(test) == 10
    for row in train + test:
        assert row["prompt"] == SCENARIO.render_agent_messages([])
        assert row["data_source"] == SCENARIO.name
        profile = UserProfile.from_dict(json.loads(row["user_profile"]))
        for dim, rng in SCENARIO.state_ranges.items():
            assert rng.min < profile.state[dim] < rng.max, (dim, profile)
        assert 1 <= len(profile.behaviors) <= 3
        assert all(b in SCENARIO.behaviors for b in profile.behaviors)
    assert [r["extra_info"]["index"] for r in test] == list(range(10))


def test_test_profiles_are_fixed_by_the_seed_and_independent_of_the_train_size(tmp_path):
    a = create_prompt_data(SCENARIO_PATH, tmp_path / "a", train_samples=5, test_samples=8, seed=1)
    b = create_prompt_data(SCENARIO_PATH, tmp_path / "b", train_samples=50, test_samples=8, seed=1)
    c = create_prompt_data(SCENARIO_PATH, tmp_path / "c", train_samples=5, test_samples=8, seed=2)
    profiles = [[r["user_profile"] for r in _rows(p["test"])] for p in (a, b, c)]
    assert profiles[0] == profiles[1] and profiles[0] != profiles[2]


def test_extremes_only_with_allow_extremes():
    assert len(valid_states(SCENARIO, allow_extremes=True)) == len(SCENARIO.state_space())
    inner = valid_states(SCENARIO)
    assert inner and all(SCENARIO.state_ranges["trust"].min < t < SCENARIO.state_ranges["trust"].max
                         for _, _, t in inner)


def test_profiles_file_is_used_in_order_and_bad_lines_name_file_and_line(tmp_path):
    good = [profile3(2, 1, 3, SCENARIO.behaviors[:2]), profile3(1, 2, 2)]
    path = tmp_path / "profiles.jsonl"
    path.write_text("\n".join(json.dumps(p.to_dict()) for p in good) + "\n")
    paths = create_prompt_data(SCENARIO_PATH, tmp_path / "out", 1, 1, profiles_file=path)
    assert json.loads(_rows(paths["train"])[0]["user_profile"]) == good[0].to_dict()
    assert json.loads(_rows(paths["test"])[0]["user_profile"]) == good[1].to_dict()
    path.write_text(json.dumps(good[0].to_dict()) + "\n" + '{"cooperation": 9, "emotion": 1, "trust": 1}\n')
    with pytest.raises(ValueError, match=r"profiles\.jsonl:2: .*cooperation=9"):
        create_prompt_data(SCENARIO_PATH, tmp_path / "out", 1, 1, profiles_file=path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"profiles\.jsonl:1: bad profile"):
        create_prompt_data(SCENARIO_PATH, tmp_path / "out", 1, 0, profiles_file=path)
    with pytest.raises(ValueError, match="has 1 profiles, need 3"):
        path.write_text(json.dumps(good[0].to_dict()) + "\n")
        create_prompt_data(SCENARIO_PATH, tmp_path / "out", 2, 1, profiles_file=path)


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    main(["--scenario", str(SCENARIO_PATH), "--train_samples", "2", "--test_samples", "1", "--out_dir",
          str(tmp_path)])
    assert (tmp_path / "train.parquet").is_file() and (tmp_path / "test.parquet").is_file()
    with pytest.raises(SystemExit, match="create_prompt_data: .*not both 0"):
        main(["--train_samples", "0", "--test_samples", "0", "--out_dir", str(tmp_path)])


def test_system_prompt_replaces_only_the_system_message_and_keeps_the_profiles(tmp_path):
    compact = "You are Mia from FoodLoop. Answer in the tags."
    own = create_prompt_data(SCENARIO_PATH, tmp_path / "own", train_samples=5, test_samples=3, seed=2)
    short = create_prompt_data(SCENARIO_PATH, tmp_path / "short", train_samples=5, test_samples=3, seed=2,
                               system_prompt=compact)
    for split in ("train", "test"):
        for a, b in zip(_rows(own[split]), _rows(short[split])):
            assert b["prompt"][0] == {"role": "system", "content": compact}
            assert b["prompt"][1:] == a["prompt"][1:] and a["prompt"][0]["content"] != compact
            assert b["user_profile"] == a["user_profile"]
    with pytest.raises(ValueError, match="system_prompt must not be empty"):
        create_prompt_data(SCENARIO_PATH, tmp_path / "empty", train_samples=1, test_samples=1, system_prompt=" ")
    main(["--scenario", str(SCENARIO_PATH), "--train_samples", "2", "--test_samples", "1", "--out_dir",
          str(tmp_path / "cli"), "--system_prompt", compact])
    assert _rows(tmp_path / "cli" / "test.parquet")[0]["prompt"][0]["content"] == compact
