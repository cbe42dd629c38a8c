"""The paper table from results files and dialogue logs: hand-computed cells in every output format."""
from __future__ import annotations

import csv
import io
import json

import pytest
from eval_fixtures import record

from for_evaluation_cli import load_script, run_table
from llm_agent.evaluation.table import build_table, load_evaluation, render
from tests.llm_agent.gen_loop_helpers import SCENARIO_PATH


def write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_results(tmp_path, name, records):
    write_log(tmp_path / f"{name}_dialogues.jsonl", records)
    path = tmp_path / f"{name}_results.json"
    path.write_text(json.dumps({"name": name, "scenario": str(SCENARIO_PATH), "dialogues_file": f"{name}_dialogues.jsonl"}))
    return path


@pytest.fixture()
def two_agents(tmp_path):
    a = [record("completed" if i < 6 else "hung_up", 4 if i < 6 else 2, i) for i in range(10)]
    b = [record("completed" if i in (0, 1, 6) else "timeout", 5, i) for i in range(10)]
    return write_results(tmp_path, "rl", a), write_results(tmp_path, "sft", b)


def test_csv_holds_hand_computed_values_and_pairs_are_tested(two_agents):
    table = build_table([load_evaluation(p) for p in two_agents], n_resamples=200)
    rows = list(csv.DictReader(io.StringIO(render(table, "csv"))))
    assert [r["agent"] for r in rows] == ["rl", "sft"]
    assert float(rows[0]["CR_value"]) == pytest.approx(0.6) and float(rows[1]["CR_value"]) == pytest.approx(0.3)
    assert float(rows[0]["ATT_value"]) == pytest.approx(4.0) and float(rows[0]["ADT_value"]) == pytest.approx(3.2)
    assert float(rows[0]["CR_low"]) <= 0.6 <= float(rows[0]["CR_high"])
    assert rows[0]["n_dialogues"] == "10"
    ((a, b, pair),) = table.pairs
    assert (a, b, pair.only_a_completed, pair.only_b_completed) == ("rl", "sft", 4, 1)
    assert pair.mcnemar_p == pytest.approx(0.375)


def test_every_format_names_every_metric(two_agents):
    table = build_table([load_evaluation(p) for p in two_agents], n_resamples=50)
    for fmt in ("terminal", "markdown"):
        text = render(table, fmt)
        for column in ("CR", "FPR", "SCR", "ATT", "ADT", "UPA", "EI", "TI", "CI", "McNemar"):
            assert column in text, (fmt, column)
        assert "0.600 [" in text and "rl vs sft" in text
    latex = render(table, "latex").splitlines()
    assert latex[1].startswith("rl & 10 & 0.600") and latex[1].endswith("\\\\") and latex[1].count("&") == 10
    assert latex[-1].startswith("% rl vs sft") and "0.375" in latex[-1]


def test_a_rollout_log_uses_the_last_validation_step(tmp_path):
    log = write_log(tmp_path / "rollouts.jsonl", [record("hung_up", 3, i, step=2, split="val") for i in range(4)]
                    + [record("completed", 3, i, step=4, split="val") for i in range(4)]
                    + [record("completed", 3, i, step=4, split="train") for i in range(8)])
    last = load_evaluation(log, scenario_path=str(SCENARIO_PATH))
    assert len(last.records) == 4 and {r["step"] for r in last.records} == {4}
    assert {r["step"] for r in load_evaluation(log, str(SCENARIO_PATH), split="val", step=2).records} == {2}
    with pytest.raises(ValueError, match="no step 3"):
        load_evaluation(log, str(SCENARIO_PATH), split="val", step=3)
    with pytest.raises(ValueError, match="pass --scenario"):
        load_evaluation(log)


def test_cli_writes_all_formats_and_rejects_bad_input(two_agents, tmp_path, capsys):
    printed = run_table([*map(str, two_agents), "--format", "markdown", "--out-dir", str(tmp_path / "t"),
                         "--n-resamples", "50"])
    assert printed.startswith("| agent | N | CR")
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["table.csv", "table.md", "table.tex", "table.txt"]
    main = load_script("metrics_table").main
    with pytest.raises(SystemExit, match="metrics_table: .*missing_results.json: no such file"):
        main([str(tmp_path / "missing_results.json")])
    with pytest.raises(SystemExit, match="names must differ"):
        main([str(two_agents[0]), str(two_agents[0])])
