"""utils/val_summary.py: the before/after line of the demo, from hand-written validation files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from utils.val_summary import read_validations, summary_line

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, rows: list[tuple[int, int, float]]) -> Path:
    lines = [json.dumps({"step": s, "n_dialogues": n, "metrics": {"completion_rate": cr, "hang_up_rate": 1 - cr}})
             for s, n, cr in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_before_and_after_of_one_run(tmp_path):
    path = _write(tmp_path / "val.jsonl", [(0, 16, 0.0625), (2, 16, 0.125), (4, 16, 0.3125)])
    assert summary_line(read_validations(path)) == \
        "validation completion rate: before 0.062 (step 0) -> after 0.312 (step 4) (16 dialogues)"


def test_a_rerun_appended_to_the_file_is_summarised_alone(tmp_path):
    # first run 0 -> 4, then a fresh run from step 0 appended to the same file
    path = _write(tmp_path / "val.jsonl", [(0, 16, 0.5), (4, 16, 0.75), (0, 8, 0.0), (2, 8, 0.25), (4, 8, 0.375)])
    assert summary_line(read_validations(path)) == \
        "validation completion rate: before 0.000 (step 0) -> after 0.375 (step 4) (8 dialogues)"


def test_a_run_with_one_validation_says_so(tmp_path):
    path = _write(tmp_path / "val.jsonl", [(0, 16, 0.5), (4, 16, 0.75), (4, 16, 0.8125)])
    assert summary_line(read_validations(path)) == \
        "validation completion rate: 0.812 (step 4, the run's only validation) (16 dialogues)"


def test_a_validation_where_every_dialogue_failed_is_na_not_zero(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps({"step": 0, "n_dialogues": 8, "metrics": {"n_dialogues": 8.0, "error_rate": 1.0}})
                    + "\n" + json.dumps({"step": 2, "n_dialogues": 8, "metrics": {"completion_rate": 0.25}}) + "\n")
    assert summary_line(read_validations(path)) == \
        "validation completion rate: before n/a (every dialogue failed) (step 0) -> after 0.250 (step 2) (8 dialogues)"


@pytest.mark.parametrize("line, message", [
    ("{not json", "val.jsonl:2: not valid JSON"),
    ('{"step": 1, "n_dialogues": 4}', "val.jsonl:2: expected an object"),
    ('{"step": "1", "n_dialogues": 4, "metrics": {"completion_rate": 0.5}}', "'step' must be an integer"),
    ('{"step": 1, "n_dialogues": 4, "metrics": {"completion_rate": 1.5}}', "completion_rate' must be a number"),
    ('{"step": 1, "n_dialogues": 4, "metrics": {}}', "completion_rate' must be a number"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps({"step": 0, "n_dialogues": 4, "metrics": {"completion_rate": 0.0}}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_validations(path)


@pytest.mark.processes
def test_command_line_prints_the_line_and_fails_clearly(tmp_path):
    path = _write(tmp_path / "val.jsonl", [(0, 4, 0.25), (3, 4, 0.75)])
    run = subprocess.run([sys.executable, "-m", "utils.val_summary", str(path)], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert run.stdout.strip() == "validation completion rate: before 0.250 (step 0) -> after 0.750 (step 3) (4 dialogues)"
    missing = subprocess.run([sys.executable, "-m", "utils.val_summary", str(tmp_path / "none.jsonl")], cwd=REPO,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "none.jsonl" in missing.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    failed = subprocess.run([sys.executable, "-m", "utils.val_summary", str(empty)], cwd=REPO, capture_output=True,
                            text=True)
    assert failed.returncode == 1 and "no validation lines" in failed.stderr
