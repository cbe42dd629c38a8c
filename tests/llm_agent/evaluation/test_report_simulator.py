"""The simulator report card's command line, its HTML (a page of its own and a section of the run report)."""
from __future__ import annotations

import html
import json
import re

import pytest

from for_evaluation import report as report_cli
from for_evaluation import simulator_report
from llm_agent.evaluation.report_simulator import render_simulator_page, simulator_html
from llm_agent.simulator_report.card import METRIC_KEYS
from tests.helpers.report_fixtures import write_run


def _row(page: str, key: str) -> list[str]:
    row = re.search(rf"<tr><td><code>{key}</code>.*?</td>(.*?)</tr>", page, re.S).group(1)
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def test_cli_grades_the_scripted_persona_and_compares_cards(tmp_path, capsys):
    out, page = tmp_path / "scripted.json", tmp_path / "cards.html"
    assert simulator_report.main(["--scripted", "--probe-dialogues", "3", "--bootstrap", "20", "--out", str(out)]) == 0
    card = json.loads(out.read_text())
    assert card["name"] == "scripted" and card["source"]["probes"]["dialogues"] == 3
    assert card["metrics"]["scripted_state_agreement"] == {"value": 1.0, "low": 1.0, "high": 1.0,
                                                          "resamples": 20}
    printed = capsys.readouterr().out
    assert "scripted_direction_agreement  1.000 [1.000, 1.000]" in printed
    other = dict(card, name="<b>other</b>", metrics={**card["metrics"], "failed_rate": None})
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert simulator_report.main(["--card", str(out), "--card", str(tmp_path / "other.json"), "--html", str(page)]) == 0
    text = page.read_text()
    assert "<b>other</b>" not in text and "&lt;b&gt;other&lt;/b&gt;" in text  # names are escaped
    assert _row(text, "failed_rate") == ["0.000 [0.000, 0.000]", "–"]
    assert all(f"<code>{key}</code>" in text for key in METRIC_KEYS)
    assert "http://" not in text and "<script" not in text
    with pytest.raises(SystemExit, match="nothing to report"):
        simulator_report.main([])
    with pytest.raises(SystemExit, match="--card"):
        simulator_report.main(["--card", str(tmp_path / "missing.json")])


def test_cli_grades_logged_dialogues(tmp_path, scenario):
    from llm_agent.simulator_report import build_probe_set

    probes = build_probe_set(scenario, n_dialogues=2)
    lines = []
    for d in probes.dialogues:  # a log of the probe calls: the history's replies were the scripted persona's
        turns = []
        for i, turn in enumerate(d.turns):
            nxt = d.turns[i + 1].messages[-2]["content"] if i + 1 < len(d.turns) else None
            user = scenario.parse_user_output(nxt) if nxt else None
            turns.append({"agent_text": scenario.format_agent_output(turn.messages[-1]["content"], 0, 0, {}),
                          "agent_status": 0, "user_source": "simulator" if user else None,
                          "user_reply": user.reply if user else None, "user_state": user.state if user else None,
                          "user_status": user.status if user else None, "user_error": None})
        lines.append({"split": "val", "step": 1, "dialogue_id": d.dialogue_id, "profile": d.profile.to_dict(),
                      "outcome": "timeout", "turns": turns, "sim_retries": 1})
    log = tmp_path / "rollouts.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "logged.json"
    assert simulator_report.main(["--dialogues", str(log), "--split", "val", "--bootstrap", "0", "--out", str(out)]) == 0
    card = json.loads(out.read_text())
    assert card["n_turns"] == probes.n_requests - len(probes.dialogues)  # each call's last reply is not logged
    assert card["metrics"]["scripted_state_agreement"] == 1.0 and card["metrics"]["first_try_valid_rate"] is None
    assert card["metrics"]["rerequests_per_turn"] == pytest.approx(2 / card["n_turns"])
    with pytest.raises(SystemExit, match="no simulator turns"):
        simulator_report.main(["--dialogues", str(log), "--split", "train", "--out", str(tmp_path / "x.json")])


def test_run_report_shows_simulator_cards(tmp_path, scenario):
    write_run(tmp_path / "outputs", "exp", scenario, steps=2, n_dialogues=8)
    card = {"name": "sim-a", "scenario": scenario.name, "n_turns": 5, "n_dialogues": 2, "source": {"kind": "test"},
            "metrics": {"first_try_valid_rate": {"value": 0.9, "low": 0.8, "high": 1.0}}, "examples": {
                "malformed_first_replies": [{"dialogue_id": "d", "turn": 0, "reply": "<oops>"}]}}
    (tmp_path / "card.json").write_text(json.dumps(card))
    page = tmp_path / "r.html"
    assert report_cli.main([str(tmp_path / "outputs"), "--out", str(page), "--bootstrap", "0",
                            "--simulator-card", str(tmp_path / "card.json")]) == 0
    text = page.read_text()
    section = re.search(r'<section id="simulator">(.*?)</section>', text, re.S).group(1)
    assert _row(section, "first_try_valid_rate") == ["0.900 [0.800, 1.000]"]
    assert "&lt;oops&gt;" in section and '<a href="#simulator">' in text
    without = simulator_html([])
    assert "python -m for_evaluation.simulator_report" in without
    assert render_simulator_page([card]).startswith("<!DOCTYPE html>")
