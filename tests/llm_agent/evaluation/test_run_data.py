"""Finding a run's files in main.sh's layout and reading them (errors name file and line)."""
from __future__ import annotations

import json
import logging

import pytest

from llm_agent.evaluation.plots import load_run
from llm_agent.evaluation.run_data import (default_plot_dir, find_latest_run, read_dialogue_summaries,
                                           read_dialogues, read_val_metrics, resolve_run)
from llm_agent.evaluation.series import OUTCOME_RATE_KEYS
from llm_agent.metrics import OUTCOMES

from tests.helpers.report_fixtures import write_run


def test_every_outcome_has_its_rate_key():
    assert set(OUTCOME_RATE_KEYS) == set(OUTCOMES)


def test_every_way_of_naming_a_run_finds_the_same_files(tmp_path, scenario):
    write_run(tmp_path / "out", "exp", scenario)
    root = tmp_path / "out"
    expected = resolve_run(root / "logs" / "exp")
    assert expected.metrics == root / "logs" / "exp" / "metrics.jsonl"
    assert expected.dialogues == root / "rollouts" / "exp" / "rollouts.jsonl"
    assert expected.val_metrics == root / "evaluation" / "val_metrics.jsonl"
    for name in (root, root / "logs" / "exp" / "metrics.jsonl", root / "rollouts" / "exp" / "rollouts.jsonl",
                 root / "rollouts" / "exp"):
        assert resolve_run(name) == expected, name
    assert default_plot_dir([expected]) == root / "plots" / "exp"
    other = resolve_run(root / "logs" / "exp")
    assert default_plot_dir([expected, other]).name == "compare_exp_vs_exp"


def test_evaluation_dialogues(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}_dialogues.jsonl").write_text("")
    assert resolve_run(tmp_path / "a_dialogues.jsonl").name == "a"
    with pytest.raises(FileNotFoundError, match="several evaluations"):
        resolve_run(tmp_path)
    (tmp_path / "b_dialogues.jsonl").unlink()
    assert resolve_run(tmp_path).dialogues == tmp_path / "a_dialogues.jsonl"


def test_missing_run_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_run(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"logs/<experiment>/metrics.jsonl"):
        find_latest_run(tmp_path)


def test_retried_evaluation_dialogue_counts_once_as_its_last_record(tmp_path):
    lines = [{"dialogue_id": "p1#0", "outcome": "error", "profile": {"cooperation": 1, "emotion": 1, "trust": 1},
              "turns": []},
             {"dialogue_id": "p2#0", "outcome": "hung_up", "profile": {"cooperation": 2, "emotion": 1, "trust": 1},
              "turns": []},
             {"dialogue_id": "p1#0", "outcome": "completed", "profile": {"cooperation": 1, "emotion": 1, "trust": 1},
              "turns": []}]
    path = tmp_path / "x_dialogues.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [(d.dialogue_id, d.outcome) for d in read_dialogues(path)] == [("p1#0", "completed"), ("p2#0", "hung_up")]
    assert [(d.dialogue_id, d.outcome) for d in read_dialogue_summaries(path)] == [("p1#0", "completed"),
                                                                                  ("p2#0", "hung_up")]
    rollout = tmp_path / "rollouts.jsonl"  # a training log keeps every line (ids repeat across steps)
    rollout.write_text(path.read_text())
    assert len(read_dialogues(rollout)) == 3


def test_an_evaluation_file_holding_several_runs_lines_is_named_in_a_warning(tmp_path, caplog):
    # the lines of two runs' validations (same ids, other splits) concatenated into one *_dialogues.jsonl file:
    # only the last per id counts, which a retry explains and several runs do not
    line = {"dialogue_id": "val0_0_0#0", "step": 0, "outcome": "hung_up", "turns": [],
            "profile": {"cooperation": 1, "emotion": 1, "trust": 1}}
    retried = tmp_path / "retried_dialogues.jsonl"
    retried.write_text(json.dumps({**line, "split": "val"}) + "\n" + json.dumps({**line, "split": "val"}) + "\n")
    mixed = tmp_path / "mixed_dialogues.jsonl"
    mixed.write_text("".join(json.dumps({**line, "split": s}) + "\n" for s in ("val", "val@scripted", "val")))
    with caplog.at_level(logging.WARNING, logger="llm_agent.evaluation.run_data"):
        assert len(read_dialogues(retried)) == 1 and len(read_dialogue_summaries(retried)) == 1
        assert not caplog.records
        assert len(read_dialogues(mixed)) == 1 and len(read_dialogue_summaries(mixed)) == 1
    assert len(caplog.records) == 2
    assert all("1 of 3 lines repeat a dialogue id with another step or split" in r.getMessage()
               for r in caplog.records)
    kept = tmp_path / "mixed.jsonl"  # the same lines under another name: every one counts
    kept.write_text(mixed.read_text())
    assert len(read_dialogues(kept)) == 3


def test_summaries_keep_only_what_the_plots_need(tmp_path, scenario):
    written = write_run(tmp_path, "exp", scenario, n_dialogues=20)
    run = load_run(resolve_run(tmp_path / "logs" / "exp"))
    assert [d.outcome for d in run.dialogues] == [d["outcome"] for d in written["dialogues"]]
    assert run.dialogues[0].turns == [] and run.dialogues[0].messages == []  # a summary: no turns held
    assert [(d.dialogue_id, d.step, d.split) for d in run.dialogues] == \
        [(d["dialogue_id"], d["step"], d["split"]) for d in written["dialogues"]]
    assert set(run.dialogues[0].profile) == {"cooperation", "emotion", "trust"} and run.dims == list(scenario.dims)
    full = load_run(resolve_run(tmp_path / "logs" / "exp"), dialogues="full").dialogues
    assert [{k: d.to_dict()[k] for k in w if k != "turns"} for d, w in zip(full, written["dialogues"])] == \
        [{k: v for k, v in w.items() if k != "turns"} for w in written["dialogues"]]
    with pytest.raises(ValueError, match="dialogues must be"):
        load_run(resolve_run(tmp_path / "logs" / "exp"), dialogues="all")


def test_validation_rows_from_the_tracked_keys_or_the_val_file(tmp_path, scenario):
    write_run(tmp_path, "exp", scenario, steps=4)
    run = load_run(resolve_run(tmp_path / "logs" / "exp"), dialogues="none")
    assert [row["step"] for row in run.val] == [0, 2, 4]  # step 0: validation before training
    assert all(not any(k.startswith("val/") for k in row) for row in run.steps)
    assert [row["step"] for row in run.steps] == [1, 2, 3, 4]
    val = read_val_metrics(tmp_path / "evaluation" / "val_metrics.jsonl")
    assert val == [{"step": 2.0, "val/dialogue/completion_rate": 0.1},
                   {"step": 4.0, "val/dialogue/completion_rate": 0.2}]


def test_bad_lines_name_file_and_line(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"outcome": "completed", "profile": {}}\nnot json\n{"outcome": "x"}\n')
    with pytest.raises(ValueError, match=r"rollouts.jsonl:2: not valid JSON"):
        read_dialogue_summaries(path)
    path.write_text('{"outcome": "completed", "profile": {}}\n{"outcome": "x"}\n')
    with pytest.raises(ValueError, match=r"rollouts.jsonl:2: a dialogue line needs 'outcome' and a 'profile'"):
        read_dialogue_summaries(path)
    val = tmp_path / "val_metrics.jsonl"
    val.write_text('{"step": "two", "metrics": {}}\n')
    with pytest.raises(ValueError, match=r"val_metrics.jsonl:1: expected"):
        read_val_metrics(val)
