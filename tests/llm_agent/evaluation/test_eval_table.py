"""The paper table from results files and dialogue logs: hand-computed cells in every output format."""
from __future__ import annotations

import csv
import io
import json
import re

import pytest

from llm_agent.evaluation.table import build_table, load_evaluation, render

from tests.helpers.eval_fixtures import record
from tests.helpers.for_evaluation_cli import load_script, run_table
from tests.helpers.repo import SCENARIO_PATH


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
    assert "95% interval]: percentile bootstrap over dialogues, 50 resamples" in render(table, "terminal")


def _tabulars(latex):
    """[(column spec, [cells per row])] of every tabular environment, read with a regex, not the renderer."""
    found = re.findall(r"\\begin\{tabular\}\{([lrc]+)\}\n(.*?)\\end\{tabular\}", latex, re.S)
    return [(spec, [row.split(" & ") for row in re.findall(r"^(.*) \\\\$", body, re.M)]) for spec, body in found]


def test_latex_is_complete_tabular_environments(two_agents):
    latex = render(build_table([load_evaluation(p) for p in two_agents], n_resamples=50), "latex")
    assert latex.count("\\begin{tabular}") == latex.count("\\end{tabular}") == 2
    (spec, rows), (pair_spec, pair_rows) = _tabulars(latex)
    assert len(rows) == 3 and all(len(r) == len(spec) == 14 for r in rows)  # agent, N, 9 metrics, 3 costs
    assert rows[0][:4] == ["Agent", "N", "CR", "FPR"] and rows[0][-3:] == ["tokens/1k", "sim calls/1k", "s/1k"]
    assert rows[1][:3] == ["rl", "10", "0.600\\,{\\scriptsize[" + rows[1][2].split("[")[1]]
    assert len(pair_rows) == 2 and all(len(r) == len(pair_spec) for r in pair_rows)
    assert pair_rows[1][0] == "rl vs sft" and pair_rows[1][-1] == "0.375"
    body = [line for line in latex.splitlines() if line and not line.startswith("%")]
    assert body[0].startswith("\\begin{tabular}") and body[-1] == "\\end{tabular}"


def _terminal_row(text, headers):
    """{header: cell} of the first row of the terminal table, sliced at the header columns' start positions."""
    header, _, row = text.splitlines()[:3]
    starts = []
    for h in headers:  # each header after the previous one ("s/1k" is also the end of "tokens/1k")
        starts.append(header.index(h, starts[-1] + 1 if starts else 0))
    return {h: row[a:b].strip() for h, a, b in zip(headers, starts, starts[1:] + [len(row)])}


def test_undefined_metrics_are_na_and_costs_are_per_thousand_dialogues(tmp_path):
    # no call completed and none claimed success: ATT and FPR are undefined, not 0
    never = [{**record("hung_up", 2 + i % 3, i), "agent_tokens": 40 + i, "sim_requests": 3, "wall_s": 0.5}
             for i in range(6)]
    table = build_table([load_evaluation(write_results(tmp_path, "stuck", never))], n_resamples=30)
    text = render(table, "terminal")
    cells = _terminal_row(text, ["agent", "N", "CR", "FPR", "SCR", "ATT", "ADT", "UPA", "CI", "EI", "TI",
                                 "tokens/1k", "sim calls/1k", "s/1k"])
    assert cells["ATT"] == "n/a" and cells["FPR"] == "n/a" and cells["CR"] == "0.000 [0.000, 0.000]"
    assert cells["ADT"].startswith("3.000 [")
    # per 1,000 dialogues: mean(40..45) = 42.5 tokens, 3 simulator requests, 0.5 s per dialogue
    assert (cells["tokens/1k"], cells["sim calls/1k"], cells["s/1k"]) == ("42.5k", "3k", "500")
    (csv_row,) = csv.DictReader(io.StringIO(render(table, "csv")))
    assert csv_row["ATT_value"] == csv_row["ATT_low"] == csv_row["FPR_value"] == ""
    assert float(csv_row["agent_tokens_per_1k_dialogues"]) == pytest.approx(42_500)
    assert float(csv_row["sim_requests_per_1k_dialogues"]) == pytest.approx(3_000)
    assert float(csv_row["seconds_per_1k_dialogues"]) == pytest.approx(500)
    assert "n/a" in render(table, "latex") and "n/a: undefined on these dialogues" in text


def test_an_interval_over_fewer_resamples_is_marked_and_counted(tmp_path):
    mixed = [record("completed", 3, 0)] + [record("hung_up", 2, i) for i in range(1, 10)]
    table = build_table([load_evaluation(write_results(tmp_path, "rare", mixed))], n_resamples=200, seed=1)
    att = table.metrics[0]["att"]
    assert 0 < att.resamples < 200  # (9/10)^10 = 35% of resamples draw no completed call
    text = render(table, "terminal")
    assert "3.000 [3.000, 3.000]*" in text and f"rare ATT {att.resamples}/200" in text


def test_a_rollout_log_uses_the_last_validation_step(tmp_path):
    log = write_log(tmp_path / "rollouts.jsonl", [record("hung_up", 3, i, step=2, split="val") for i in range(4)]
                    + [record("completed", 3, i, step=4, split="val") for i in range(4)]
                    + [record("completed", 3, i, step=4, split="train") for i in range(8)])
    last = load_evaluation(log, scenario_path=str(SCENARIO_PATH))
    assert len(last.records) == 4 and {r.step for r in last.records} == {4}
    assert {r.step for r in load_evaluation(log, str(SCENARIO_PATH), split="val", step=2).records} == {2}
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


def _turn(agent, user, stage, status):
    """One turn with (cooperation, emotion, trust) estimates of the agent and states of the simulator."""
    dims = ("cooperation", "emotion", "trust")
    return {"agent_state": dict(zip(dims, agent)), "user_state": dict(zip(dims, user)), "agent_stage": stage,
            "agent_status": status, "user_source": "simulator"}


def test_every_paper_column_on_a_hand_computed_fixture(tmp_path):
    # outbound_ad_trial.yaml: cooperation 0-4, emotion 0-3, trust 0-5 (spans 4, 3, 5); stages 0-3
    done = {**record("completed", 2, 0, profile=(1, 1, 1)),
            "turns": [_turn((1, 1, 1), (2, 1, 2), 0, 0), _turn((2, 2, 2), (3, 2, 4), 1, 1)]}
    false_claim = {**record("hung_up", 1, 1, profile=(2, 2, 2)), "turns": [_turn((2, 2, 2), (0, 0, 1), 2, 1)]}
    failed = record("error", 0, 2, profile=(0, 0, 0))  # left out of every column below
    path = write_results(tmp_path, "x", [done, false_claim, failed])
    table = build_table([load_evaluation(path)], n_resamples=20)
    (row,) = csv.DictReader(io.StringIO(render(table, "csv")))
    turn_errors = [(1 / 4 + 0 / 3 + 1 / 5) / 3, (1 / 4 + 0 / 3 + 2 / 5) / 3, (2 / 4 + 2 / 3 + 1 / 5) / 3]
    expected = {
        "CR": 1 / 2,  # one of the two non-error dialogues completed
        "FPR": 1 / 2,  # both claimed done on their last turn; the hung-up one falsely
        "SCR": 1 / 2,  # stages 0,1 complete; stage 2 alone skips 0 and 1
        "ATT": 2.0, "ADT": (2 + 1) / 2,
        "UPA": 1 - sum(turn_errors) / 3,
        "EI": ((2 - 1) + (0 - 2)) / 2,  # profile value to the simulator's last emotion
        "TI": ((4 - 1) + (1 - 2)) / 2,
        "CI": ((3 - 1) + (0 - 2)) / 2,
    }
    for column, value in expected.items():
        assert float(row[f"{column}_value"]) == pytest.approx(value, abs=1e-9), column
    assert row["n_dialogues"] == "3"
