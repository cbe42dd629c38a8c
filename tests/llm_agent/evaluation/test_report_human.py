"""Calls a person played (`judge: human`) read back as their own split beside an evaluation's, in the readers and
in report.py (a human_dialogues.jsonl beside the evaluation, or --human FILE)."""
from __future__ import annotations

import json
import random
import re

from for_evaluation import report
from llm_agent.evaluation.run_data import read_dialogue_summaries, read_dialogues, resolve_run

from tests.helpers.report_fixtures import synthetic_dialogue


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(scenario, n, seed, human=False):
    rng = random.Random(seed)
    rows = [synthetic_dialogue(rng, scenario, i, 0, "eval") for i in range(n)]
    for i, row in enumerate(rows):
        row["dialogue_id"] = f"{'human' if human else 'test'}{seed}-{i}#0"
        if human:
            row["judge"] = "human"
    return rows


def _embedded_splits(html):
    data = json.loads(re.search(r'<script id="dialogue-data" type="application/json">(.*?)</script>', html,
                                re.S).group(1))
    return sorted(d["split"] for d in data["dialogues"])


def test_human_lines_read_back_as_their_own_split(scenario, tmp_path):
    path = _write(tmp_path / "human_dialogues.jsonl", _rows(scenario, 2, 1, human=True))
    assert [r.split for r in read_dialogues(path)] == ["eval@human"] * 2
    assert [r.split for r in read_dialogue_summaries(path)] == ["eval@human"] * 2
    assert [r.extra["judge"] for r in read_dialogues(path)] == ["human"] * 2


def test_the_report_shows_human_calls_beside_and_from_elsewhere(scenario, tmp_path, capsys):
    evaluation = _write(tmp_path / "eval" / "rl_dialogues.jsonl", _rows(scenario, 3, 2))
    _write(tmp_path / "eval" / "human_dialogues.jsonl", _rows(scenario, 2, 3, human=True))
    elsewhere = _write(tmp_path / "other" / "human_dialogues.jsonl", _rows(scenario, 1, 4, human=True))
    files = resolve_run(tmp_path / "eval")  # the directory: the simulated evaluation, the person's calls along
    assert files.dialogues == evaluation and files.human == (tmp_path / "eval" / "human_dialogues.jsonl",)
    out = tmp_path / "r.html"
    assert report.main([str(evaluation), "--human", str(elsewhere), "--out", str(out), "--bootstrap", "0"]) == 0
    html = out.read_text()
    assert _embedded_splits(html) == ["eval"] * 3 + ["eval@human"] * 3
    assert "eval@human" in html.split('id="metrics"', 1)[1].split("</section>", 1)[0]
