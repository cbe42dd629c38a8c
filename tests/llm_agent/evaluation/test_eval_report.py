"""The HTML report: one self-contained file, its plots, metrics table, analysis section and embedded dialogues."""
from __future__ import annotations

import html
import json
import re

import pytest

from for_evaluation import report as report_cli
from llm_agent.evaluation.browser_data import embed_json
from llm_agent.evaluation.page_text import MAX_PAGE_STRING
from llm_agent.evaluation.plots import figure_names
from llm_agent.evaluation.report import build_report, default_report_path, dialogue_groups
from llm_agent.evaluation.run_data import resolve_run
from llm_agent.metrics import dialogue_metrics
from llm_agent.rollout.dialogue_record import DialogueRecord
from tests.helpers.record_factory import typed
from tests.helpers.report_fixtures import synthetic_dialogues, write_run

FIGURE_NAMES = figure_names(("cooperation", "emotion", "trust"))  # the shipped scenarios' figures

DATA_RE = re.compile(r'<script id="dialogue-data" type="application/json">(.*?)</script>', re.S)


def _embedded(page: str) -> dict:
    return json.loads(DATA_RE.search(page).group(1))


def _metric_row(page: str, key: str) -> list[str]:
    row = re.search(rf"<tr><td><code>{key}</code></td>(.*?)</tr>", page).group(1)
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def test_report_is_one_self_contained_file(tmp_path, scenario):
    written = write_run(tmp_path / "outputs", "exp", scenario)
    files = resolve_run(tmp_path / "outputs")
    path = build_report(files, scenario, bootstrap=0)
    assert path == tmp_path / "outputs" / "reports" / "exp.html" == default_report_path(files)
    assert sorted(p.name for p in path.parent.iterdir()) == ["exp.html"]  # nothing beside it
    page = path.read_text()
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(link|iframe)\b", page) and not re.search(r"<script[^>]*\bsrc=", page)
    assert all(src.startswith("data:image/png;base64,") for src in re.findall(r'\bsrc="([^"]*)"', page))
    assert len(re.findall(r'<figure id="plot-', page)) == len(FIGURE_NAMES) - 1  # all but the time split
    data = _embedded(page)
    assert [d["id"] for d in data["dialogues"]] == [d["dialogue_id"] for d in written["dialogues"]]
    assert data["stages"] == {str(s.id): s.name for s in scenario.stages}


def test_metrics_table_columns_are_the_last_steps_and_all_training(tmp_path, scenario):
    written = write_run(tmp_path, "exp", scenario, steps=6, n_dialogues=150)
    page = build_report(resolve_run(tmp_path / "logs" / "exp"), scenario, tmp_path / "r.html", bootstrap=0) \
        .read_text()
    dialogues = written["dialogues"]
    train = [d for d in dialogues if d["split"] == "train"]
    last_train = [d for d in train if d["step"] == 6]
    last_val = [d for d in dialogues if d["split"] == "val" and d["step"] == max(
        x["step"] for x in dialogues if x["split"] == "val")]
    header = re.search(r"<section id=\"metrics\">.*?<thead><tr>(.*?)</tr>", page, re.S).group(1)
    labels = [html.unescape(x) for x in re.findall(r"<th[^>]*>(.*?)</th>", header)]
    assert labels[0] == "metric" and labels[1:3] == ["train (steps 1-6)", "train (step 6)"]
    assert labels[3].startswith("val (step ")
    expected = [dialogue_metrics(typed(g), scenario)["completion_rate"] for g in (train, last_train, last_val)]
    assert _metric_row(page, "completion_rate") == [f"{v:.3f}" for v in expected]
    assert int(_metric_row(page, "n_dialogues")[0]) == len(train)


def test_metric_intervals_come_from_the_bootstrap(tmp_path, scenario):
    write_run(tmp_path, "exp", scenario, steps=2, n_dialogues=40)
    page = build_report(resolve_run(tmp_path / "logs" / "exp"), scenario, tmp_path / "r.html", bootstrap=30) \
        .read_text()
    pooled, cell = _metric_row(page, "completion_rate")[:2]
    assert re.fullmatch(r"[\d.]+", pooled)  # training pooled over steps: no interval
    value, low, high = (float(x) for x in re.fullmatch(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", cell).groups())
    assert low <= value <= high and low < high
    assert "30 resamples" in page


def test_analysis_section_per_split(tmp_path, scenario):
    write_run(tmp_path, "exp", scenario, steps=4)
    page = build_report(resolve_run(tmp_path / "logs" / "exp"), scenario, tmp_path / "r.html", bootstrap=0) \
        .read_text()
    section = re.search(r'<section id="mistakes">(.*?)</section>', page, re.S).group(1)
    assert "train (steps 1-4)" in section and "val (step 4)" in section
    assert section.count("Where failed calls end") == 2
    assert "Weights the controller's rule recommends" in section


def test_dialogue_groups():
    rows = [{"split": "train", "step": s} for s in (1, 2, 2)] + [{"split": "val", "step": s} for s in (0, 2)] + \
        [{"split": None, "step": None}]
    table, analysis = dialogue_groups([DialogueRecord(f"d{i}", "completed", [], split=r["split"], step=r["step"])
                                       for i, r in enumerate(rows)])
    assert [(g.label, len(g.records)) for g in table] == [("train (steps 1-2)", 3), ("train (step 2)", 2),
                                                          ("all", 1), ("val (step 2)", 1)]
    assert [g.label for g in analysis] == ["train (steps 1-2)", "all", "val (step 2)"]


def test_embedded_text_cannot_close_the_script():
    text = embed_json({"t": "</script><script>alert(1)</script> <!-- & \u2028"})
    assert "</" not in text and "<!--" not in text and "\u2028" not in text
    assert json.loads(text)["t"] == "</script><script>alert(1)</script> <!-- & \u2028"


def test_evaluation_dialogues_report_and_cli(tmp_path, scenario, capsys):
    path = tmp_path / "rl_dialogues.jsonl"
    dialogues = synthetic_dialogues(scenario, 30, seed=3, steps=1)
    for d in dialogues:
        d["split"] = "test"
    path.write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    assert report_cli.main([str(path), "--bootstrap", "0"]) == 0
    out = tmp_path / "rl_report.html"
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert len(_embedded(page)["dialogues"]) == 30
    assert "No plots" not in page and '<figure id="plot-cr_by_initial_state"' in page


def test_an_evaluations_headline_and_table_give_its_cr_one_interval_and_claim_no_before_after(tmp_path, scenario):
    # the headline once used a Wilson interval and the table a bootstrap one for the same dialogues' CR, and the
    # per-state plot of a single evaluation was captioned "before and after training"
    path = tmp_path / "rl_dialogues.jsonl"
    dialogues = synthetic_dialogues(scenario, 30, seed=3, steps=1)
    for d in dialogues:
        d["split"] = "eval"
    path.write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    page = build_report(resolve_run(path), scenario, bootstrap=50).read_text()
    (cell,) = _metric_row(page, "completion_rate")
    headline = html.unescape(re.sub(r"<[^>]+>", "", re.search(r'<p id="headline".*?</p>', page, re.S).group(0)))
    table_interval = re.fullmatch(r"[\d.]+ (\[[\d.]+, [\d.]+\])", cell).group(1)
    assert f"{table_interval}, " in headline and "Wilson" not in headline
    assert "bootstrap interval" in headline
    caption = re.search(r'<figure id="plot-cr_by_initial_state">.*?<figcaption>(.*?)</figcaption>', page, re.S)
    assert "before and after" not in caption.group(1) and "nothing before or after to compare" in caption.group(1)


def test_bad_dialogue_line_names_the_file(tmp_path, scenario):
    path = tmp_path / "x_dialogues.jsonl"
    path.write_text('{"outcome": "completed", "profile": {}}\n')
    with pytest.raises(ValueError, match="x_dialogues.jsonl:1: dialogue .* has no \\['turns'\\]"):
        build_report(resolve_run(path), scenario, bootstrap=0)


def test_browser_holds_the_last_dialogues_and_the_metrics_all(tmp_path, scenario):
    written = write_run(tmp_path, "exp", scenario, steps=2, n_dialogues=40)
    page = build_report(resolve_run(tmp_path / "logs" / "exp"), scenario, tmp_path / "r.html", bootstrap=0,
                        browser_limit=10).read_text()
    assert [d["id"] for d in _embedded(page)["dialogues"]] == [d["dialogue_id"] for d in written["dialogues"][-10:]]
    assert "The browser holds the last 10 of the 40 dialogues." in page
    train = [d for d in written["dialogues"] if d["split"] == "train"]
    assert int(_metric_row(page, "n_dialogues")[0]) == len(train)


def test_headline_points_from_dialogues_val_metrics_or_nothing():
    from llm_agent.evaluation.headline import CRPoint, cr_points, headline_html

    def dialogue(step, outcome, split="val"):
        return {"step": step, "split": split, "outcome": outcome, "turns": []}

    records = [dialogue(0, "completed"), dialogue(0, "hung_up"), dialogue(0, "error"), dialogue(3, "completed"),
               dialogue(3, "completed"), dialogue(3, "timeout"), dialogue(3, "completed"), dialogue(2, "hung_up", "train")]
    before, after = cr_points(typed(records), [], lambda group: (0.0, len(group) / 10))
    assert (before.label, before.completed, before.n, before.cr) == ("before: val, step 0", 1, 2, 0.5)
    assert (after.label, after.completed, after.n, after.cr) == ("after: val, step 3", 3, 4, 0.75)
    assert before.interval == (0.0, 0.3) and after.interval == (0.0, 0.4)  # the groups the interval was given
    page = headline_html([before, after], "the table's")
    assert 'id="headline"' in page and "(+0.250)" in page and "&rarr;" in page and "brackets: the table&#x27;s" in page
    unbounded = cr_points(typed(records), [])
    assert unbounded[0].interval is None and "bootstrap off" in headline_html(unbounded)
    # every validation dialogue of the first step failed: n/a, and no change is claimed
    failed = cr_points(typed([dialogue(0, "error"), dialogue(1, "completed")]), [])
    assert failed[0].text() == "n/a (every dialogue failed)" and "cr-change" not in headline_html(failed)
    # no dialogues logged: the tracked val metrics, without an interval
    rows = [{"step": 0.0, "val/dialogue/completion_rate": 0.0}, {"step": 2.0, "x": 1.0},
            {"step": 4.0, "val/dialogue/completion_rate": 0.25}]
    assert cr_points(None, rows) == [CRPoint("before: val, step 0", 0.0), CRPoint("after: val, step 4", 0.25)]
    assert "no interval" in headline_html(cr_points(None, rows))
    assert cr_points(None, []) == [] and headline_html([]) == ""


def test_an_undefined_metric_is_na_in_the_metrics_table():
    from llm_agent.evaluation.report_sections import metrics_html

    page = metrics_html([("eval (step 2)", {"att": {"value": None, "low": None, "high": None},
                                            "adt": {"value": 2.5, "low": 2.0, "high": 3.0}}),
                         ("train (steps 1-2)", {"adt": 2.5})], "note", ["att", "adt"])
    att_row = page.split("<code>att</code>", 1)[1].split("</tr>", 1)[0]
    assert att_row.count("n/a") == 2 and "None" not in page  # an interval of nothing, and a value left out
    assert "2.500 <span" in page.split("<code>adt</code>", 1)[1]


def test_every_string_on_the_pages_is_bounded(tmp_path, scenario):
    huge = "x" * (4 * MAX_PAGE_STRING) + "QQ-FIELD-END-QQ"
    path = tmp_path / "rl_dialogues.jsonl"
    dialogues = synthetic_dialogues(scenario, 10, seed=3, steps=1)
    for d in dialogues:
        d["split"] = "test"
    dialogues[3]["turns"][0]["user_reply"] = huge
    dialogues[4]["error"] = huge
    dialogues[5]["profile"]["behaviors"] = [{"category": huge, "behavior": huge}]
    path.write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    card = {"name": huge, "metrics": {}, "source": {"kind": huge}, "examples": {"x": [{"reply": huge}]}}
    (tmp_path / "card.json").write_text(json.dumps(card))
    small = tmp_path / "small.html"
    assert report_cli.main([str(path), "--bootstrap", "0", "--out", str(tmp_path / "page.html"),
                            "--simulator-card", str(tmp_path / "card.json")]) == 0
    page = (tmp_path / "page.html").read_text()
    assert "QQ-FIELD-END-QQ" not in page and f"… [{len(huge) - MAX_PAGE_STRING} more characters cut]" in page
    assert max(map(len, re.findall("x+", page))) == MAX_PAGE_STRING  # every copy of every field cut
    assert len(page) < 20 * MAX_PAGE_STRING + len(_baseline_page(tmp_path, scenario, small))
    data = _embedded(page)
    marker = f"… [{len(huge) - MAX_PAGE_STRING} more characters cut]"
    assert data["dialogues"][3]["t"][0]["ur"] == huge[:MAX_PAGE_STRING] + marker


def _baseline_page(tmp_path, scenario, out) -> str:
    path = tmp_path / "clean_dialogues.jsonl"
    dialogues = synthetic_dialogues(scenario, 10, seed=3, steps=1)
    for d in dialogues:
        d["split"] = "test"
    path.write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    assert report_cli.main([str(path), "--bootstrap", "0", "--out", str(out)]) == 0
    return out.read_text()
