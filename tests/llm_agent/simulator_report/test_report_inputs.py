"""Issue 42's probes of what the simulator report card and the simulator SFT read from outside: logs with fields of
the wrong type, malformed card files, an endpoint that fails its check and URLs no client would use end in one line
naming the problem, never a traceback (nor aiohttp's "Unclosed client session")."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.simulator_sft_ingestion import write_log
from for_evaluation.simulator_report import main as report_main
from tests.helpers.for_evaluation_cli import load_script
from tests.helpers.repo import REPO, SCENARIO_PATH
from tests.helpers.sim_servers import free_port
from utils.check_simulators import main as check_main


def _log(tmp_path, change=None):
    path = tmp_path / "rollouts.jsonl"
    write_log(path, str(SCENARIO_PATH), dialogues=2, turns=3, huge_chars=0)
    if change is not None:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        change(lines[1])
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _set(path, value):
    def change(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


WRONG_TYPES = [  # read once, by DialogueRecord.from_dict: the error names the file, the line and the field
    (("turns",), "many", "'turns' must be a list of turn dicts, got str"),
    (("turns", 0), 5, "turn 0: a turn must be an object, got int"),
    (("turns", 1, "user_reply"), 123, "turn 1.user_reply must be a string or null, got int"),
    (("turns", 0, "user_reply"), ["a"], "turn 0.user_reply must be a string or null, got list"),
    (("turns", 0, "agent_text"), {"a": 1}, "turn 0.agent_text must be a string or null"),
    (("turns", 0, "user_state"), [1, 2, 3], "turn 0.user_state must be an object of dimension -> integer"),
    (("turns", 0, "user_state"), {"trust": "high"}, "turn 0.user_state.trust must be an integer or null"),
    (("turns", 0, "user_status"), "0", "turn 0.user_status must be an integer or null, got '0'"),
    (("turns", 0, "user_status"), True, "turn 0.user_status must be an integer or null, got True"),
    (("turns", 0, "user_status"), "9" * 100_000, "turn 0.user_status must be an integer or null, got '999"),
    (("turns", 0, "user_source"), 7, "turn 0.user_source must be a string or null"),
    (("sim_retries",), "many", "'sim_retries' must be a non-negative int, got 'many'"),
    (("profile",), "nobody", "'profile' must be an object, got str"),
]


@pytest.mark.parametrize("path, value, message", WRONG_TYPES)
def test_the_card_names_a_wrong_typed_log_field_in_one_line(tmp_path, path, value, message):
    log = _log(tmp_path, _set(path, value))
    with pytest.raises(SystemExit) as exc:
        report_main(["--dialogues", str(log), "--bootstrap", "0", "--out", str(tmp_path / "card.json")])
    text = str(exc.value.code)
    assert text.startswith(f"simulator report: {log}:2: ") and message in text, text
    assert "\n" not in text and len(text) < 300 + len(str(log))  # a huge value is cut


@pytest.mark.parametrize("path, value, message", WRONG_TYPES[:4])
def test_the_sft_names_a_wrong_typed_log_field_in_one_line(tmp_path, tiny_model_path, path, value, message):
    from utils.simulator_sft import main as sft_main

    log = _log(tmp_path, _set(path, value))
    with pytest.raises(SystemExit) as exc:
        sft_main(["--model", tiny_model_path, "--out", str(tmp_path / "out"), "--rollouts", str(log), "--steps", "1"])
    text = str(exc.value.code)
    assert text.startswith(f"simulator_sft: {log}:2: ") and message in text and "\n" not in text, text
    assert not (tmp_path / "out").exists()


CARDS = [
    ("[]", "a card is a JSON object, got list"),
    ('{"name": 3, "metrics": {}}', "'name' must be a string"),
    ('{"name": "x"}', "'metrics' must be an object"),
    ('{"name": "x", "metrics": {"format_valid_rate": "high"}}', "metric 'format_valid_rate' must be null"),
    ('{"name": "x", "metrics": {"format_valid_rate": {"value": 1, "low": "a", "high": 2}}}', "must be null"),
    ('{"name": "x", "metrics": {"failed_rate": NaN}}', "non-finite number NaN"),
    ('{"name": "x", "metrics": {}, "examples": {"bad": ["reply"]}}', "examples 'bad' must be a list of objects"),
    ('{"name": "x", "metrics": {}, "source": "me"}', "'source' must be an object"),
    ('{"name": "x", "metrics": {}, "human": [1]}', "'human' must be an object"),
    ('{"name": "x", "metrics": {}, "by_agent": [1]}', "'by_agent' must be an object"),
    ('{"name": "x", "metrics": {}, "by_agent": {"good": {"format_valid_rate": "all"}}}', "by_agent 'good' must be"),
    ("[" * 5000, "nested 5000 levels deep"),
    ("{not json", "not valid JSON"),
]


@pytest.mark.parametrize("text, message", CARDS)
def test_a_malformed_card_file_is_one_line(tmp_path, text, message):
    card = tmp_path / "card.json"
    card.write_text(text)
    with pytest.raises(SystemExit) as exc:
        report_main(["--card", str(card)])
    assert str(exc.value.code).startswith(f"--card: {card}") and message in str(exc.value.code)
    report = load_script("report")
    with pytest.raises(SystemExit) as exc:
        report.main([str(_log(tmp_path)), "--simulator-card", str(card), "--out", str(tmp_path / "r.html")])
    assert str(exc.value.code).startswith(f"--simulator-card: {card}") and message in str(exc.value.code)


def test_a_card_with_an_odd_human_section_still_prints(tmp_path, capsys):
    """A hand-edited `human` section: what is not an object is skipped, the rest shown."""
    card = tmp_path / "card.json"
    card.write_text('{"name": "x", "metrics": {}, "human": {"sources": {"scripted": {"n_turns": 2, "metrics": '
                    '{"status_agreement": 0.5}}, "simulator": [3], "other": {"metrics": "high"}}}}')
    assert report_main(["--card", str(card), "--html", str(tmp_path / "c.html")]) == 0
    out = capsys.readouterr().out
    assert "x:scripted" in out and "x:simulator" not in out and "x:other" not in out
    assert next(line for line in out.splitlines() if line.startswith("status_agreement")).split()[1] == "0.500"
    assert "Agreement with people" in (tmp_path / "c.html").read_text()


def test_the_agreement_per_probing_agent_is_printed_beside_each_card(tmp_path, capsys):
    paths = []
    for name, agreement in (("a", 0.25), ("b", 0.75)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"name": name, "metrics": {}, "by_agent": {"wrong_answer": {
            "n_turns": 8, "scripted_direction_agreement": {"value": agreement, "low": 0.0, "high": 1.0}}}}))
    assert report_main(["--card", str(paths[0]), "--card", str(paths[1])]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("wrong_answer: scripted_direction_agreement"))
    assert "0.250 [0.000, 1.000]" in row and row.index("0.250") < row.index("0.750 [0.000, 1.000]")


def test_a_card_with_missing_bounds_still_prints(tmp_path, capsys):
    card = tmp_path / "card.json"
    card.write_text('{"name": "x", "metrics": {"failed_rate": {"value": 0.5, "low": null, "high": null}}}')
    assert report_main(["--card", str(card)]) == 0
    assert "0.500 [-, -]" in capsys.readouterr().out


@pytest.mark.processes
def test_a_failing_endpoint_check_is_one_line_and_closes_the_client(tmp_path):
    done = subprocess.run([sys.executable, "-m", "for_evaluation.simulator_report", "--user-sim-urls",
                           f"http://127.0.0.1:{free_port()}", "--probe-dialogues", "2", "--timeout", "2",
                           "--out", str(tmp_path / "card.json")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("simulator report: ") and len(done.stderr.strip().splitlines()) == 1, \
        done.stderr
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr


@pytest.mark.parametrize("url, message", [
    ('http://127.0.0.1:5000/"x', "contains a quote"), ("http://127.0.0.1:99999", "port in 1-65535"),
    ("http://127.0.0.1:5000\r\nHost: evil", "contains a carriage return"), ("ftp://127.0.0.1:21", "http(s)"),
    ("http://127.0.0.1:5000/?token=s3cret", "query string"), ("http://127.0.0.1:5000/a b", "contains a space"),
])
def test_check_simulators_refuses_what_the_client_refuses(url, message, capsys):
    with pytest.raises(SystemExit) as exc:
        check_main([url, "--timeout", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "s3cret" not in err and "evil" not in err
