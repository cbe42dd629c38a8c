"""The profile writer against a scripted OpenAI-compatible server on 127.0.0.1 (answering well, badly, not at all).

Scores must come from the plan (independently: a run with no LLM draws the same states), behaviours only from the
library file, bad answers must be rejected, counted and kept, and a killed run must resume with only the missing
indices.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from llm_agent.profiles.pool import profile_of_row
from llm_agent.profiles.rules import load_rule_table
from llm_agent.profiles.sources import ChatEndpoint
from llm_agent.profiles.writer import ProfileWriter, WriterSettings
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.stand_ins.profile_llm import ScriptedProfileLLM
from tests.helpers.profiles import DIMS

REPO = Path(__file__).resolve().parents[3]
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
LIBRARY = {(o["category"], o["behavior"]) for o in map(json.loads, (REPO / "assets/client_action.jsonl").open())}
RULES = load_rule_table()


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def state(row):
    return tuple(row["profile"][d] for d in DIMS)


def write(out, n, url=None, timeout=5.0, **settings):
    endpoint = ChatEndpoint(url, "scripted", timeout_s=timeout) if url else None
    try:
        return ProfileWriter(SCENARIO, out, WriterSettings(n=n, concurrency=4, **settings), RULES,
                             endpoint=endpoint).run()
    finally:
        if endpoint:
            endpoint.close()


@pytest.fixture(scope="module")
def rule_only(tmp_path_factory):
    out = tmp_path_factory.mktemp("rules") / "p.jsonl"
    write(out, 80)
    return rows(out)


@pytest.mark.parametrize("mode", ["good", "mixed", "bad"])
def test_scores_never_change_and_behaviours_are_in_the_library(tmp_path, rule_only, mode):
    with ScriptedProfileLLM(mode, bad_share=0.4) as llm:
        stats = write(tmp_path / "p.jsonl", 80, llm.url)
    got = rows(tmp_path / "p.jsonl")
    assert [r["index"] for r in got] == list(range(80))
    assert [state(r) for r in got] == [state(r) for r in rule_only]  # the plan, whatever the LLM answered
    for r in got:
        assert {(b["category"], b["behavior"]) for b in r["profile"]["behaviors"]} <= LIBRARY
        assert 1 <= len(r["profile"]["behaviors"]) <= 3
    assert len({(state(r), frozenset(b["behavior"] for b in r["profile"]["behaviors"])) for r in got}) == 80
    assert stats["rows_violating_rules"] == {}  # rule_check=repair (the default)
    if mode != "good":
        assert stats["this_run"]["rejected/score_changed"] > 0  # the server did try to change scores


def test_bad_answers_are_rejected_counted_kept_and_fall_back_to_the_rules(tmp_path):
    with ScriptedProfileLLM("bad") as llm:
        stats = write(tmp_path / "p.jsonl", 40, llm.url, max_attempts=2)
        requests = llm.requests
    rejected = rows(tmp_path / "p.jsonl.rejected.jsonl")
    counted = {k.split("/", 1)[1]: v for k, v in stats["this_run"].items() if k.startswith("rejected/")}
    assert Counter(r["reason"] for r in rejected) == counted
    assert {"malformed", "score_changed", "out_of_library"} <= set(counted)
    assert all(r["answer"] for r in rejected)  # the answer text is kept for inspection
    got = rows(tmp_path / "p.jsonl")
    llm_rows = sum(r["source"] == "llm" for r in got)
    assert llm_rows + stats["this_run"]["fallback/attempts_exhausted"] == 40
    assert requests == sum(r["attempts"] for r in got) == len(rejected) + llm_rows
    assert not any(RULES.violations(profile_of_row(r), SCENARIO.state_ranges) for r in got)


@pytest.mark.parametrize("mode", ["error", "silent", "refused"])
def test_an_endpoint_that_does_not_answer_falls_back_to_the_rules(tmp_path, rule_only, mode):
    if mode == "refused":
        with ScriptedProfileLLM("good") as llm:
            url = llm.url  # nothing listens there any more
        stats = write(tmp_path / "p.jsonl", 80, url)
    else:
        with ScriptedProfileLLM(mode, silent_s=5.0) as llm:
            stats = write(tmp_path / "p.jsonl", 80, llm.url, timeout=0.3, breaker=6)
    got = rows(tmp_path / "p.jsonl")
    assert [r["source"] for r in got] == ["rule"] * 80 and [state(r) for r in got] == [state(r) for r in rule_only]
    rejected = rows(tmp_path / "p.jsonl.rejected.jsonl")
    kind = {"error": "endpoint_http", "silent": "endpoint_timeout", "refused": "endpoint_connection"}[mode]
    assert stats["this_run"][f"rejected/{kind}"] == len(rejected) >= 1
    assert stats["this_run"].get("fallback/endpoint_down", 0) > 0  # the breaker stopped asking
    assert stats["this_run"].get("fallback/endpoint_down", 0) + stats["this_run"].get(
        "fallback/attempts_exhausted", 0) == 80


@pytest.mark.processes
def test_resume_after_a_kill_writes_only_what_is_missing(tmp_path):
    out = tmp_path / "p.jsonl"
    cmd = [sys.executable, "-m", "utils.generate_profiles", "--n", "60", "--out", str(out), "--concurrency", "2"]
    with ScriptedProfileLLM("good", delay_s=0.05) as llm:
        proc = subprocess.Popen([*cmd, "--llm-url", llm.url], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 15):
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with out.open("a") as f:  # a torn line, as a kill mid-write leaves it
            f.write('{"index": 59, "source": "llm", "prof')
        before = {r["index"]: r for r in map(json.loads, out.read_text().splitlines()[:-1])}
        assert 15 <= len(before) < 60
        time.sleep(0.3)  # let requests the killed run had in flight arrive
        first_run = llm.requests
        done = subprocess.run([*cmd, "--llm-url", llm.url], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        second_run = llm.requests - first_run
    after = rows(out)
    assert [r["index"] for r in after] == list(range(60))
    assert second_run == sum(r["attempts"] for r in after if r["index"] not in before)  # only the missing ones
    assert all(after[i] == row for i, row in before.items())  # nothing written before the kill was redone
    stats = json.loads(done.stdout[:done.stdout.rindex("}") + 1])
    assert stats["written_now"] == 60 - len(before) and stats["already_written"] == len(before)


def test_resuming_with_other_settings_is_refused(tmp_path):
    write(tmp_path / "p.jsonl", 10)
    with pytest.raises(ValueError, match=r"p\.jsonl was started with other plan, settings"):
        write(tmp_path / "p.jsonl", 10, seed=1)
