"""bench/chat_turns.py plays whole calls through the chat page's server, the person played by the scripted
persona's preview, and times every agent turn."""
from __future__ import annotations

import json

import pytest

from bench.chat_turns import main


@pytest.mark.processes  # bench.results reads the machine (platform.processor() runs uname)
def test_the_benchmark_plays_whole_calls_and_times_each_agent_turn(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "chat_turns.json"
    main(["--agent", "scripted:good", "--tokenizer", tiny_model_path, "--calls", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    calls = result["calls"]
    assert len(calls) == 2 and all(c["phase"] == "done" and c["error"] is None for c in calls)
    assert sum(result["outcomes"].values()) == 2
    replies = [s for c in calls for s in c["reply_s"]]
    assert replies and all(s > 0 for s in replies) and all(c["opening_s"] > 0 for c in calls)
    assert result["after_reply"]["n"] == len(replies) and result["opening"]["n"] == 2
    assert result["after_reply"]["max"] == max(replies) and result["after_reply"]["p50"] <= max(replies)
    assert "after a reply" in capsys.readouterr().out
