"""Streaming the agent's turn: a local HF agent's call streamed (the page's `partial`, Server-Sent Events at
/api/stream) gives the same record and final turn as with --no-stream; the event stream of a person's turn; the
partial turn restarting with a retried attempt, and its cap."""
from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlsplit

from llm_agent.evaluation.human_calls import HUMAN_FILE, MAX_PARTIAL_CHARS, HumanCall

from tests.helpers.chat_fixtures import read_lines, request, running_chat, same_part

PROFILE = {"profile": {"state": {"cooperation": 2, "emotion": 2, "trust": 2}, "behaviors": [0]}}
def _events(server, seen, ready):
    """The /api/stream events until the server ends the stream, into `seen`."""
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("GET", f"/api/stream?token={server.token}")
        response = conn.getresponse()
        seen.append(("status", response.status, response.getheader("Content-Type")))
        ready.set()
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: "):
                seen.append(json.loads(line[len("data: "):]))
    finally:
        ready.set()
        conn.close()


def _call(tiny_model_path, out, *extra):
    with running_chat(tiny_model_path, out, "--max-turns", "3", *extra, agent=tiny_model_path) as server:
        status, call = request(server, "POST", "/api/call", PROFILE)
        assert status == 200 and call["phase"] == "done", call
    return call, read_lines(out / HUMAN_FILE)[-1]


def test_a_streamed_call_is_recorded_as_without_streaming(tiny_model_path, tmp_path):
    streamed, line = _call(tiny_model_path, tmp_path / "s")
    plain, plain_line = _call(tiny_model_path, tmp_path / "p", "--no-stream")
    assert streamed["streams"] is True and plain["streams"] is False and plain["partial"] is None
    assert line["num_turns"] == plain_line["num_turns"] == 3  # greedy: the same three agent turns
    assert same_part(line) == same_part(plain_line)
    assert streamed["result"]["last_agent"] == plain["result"]["last_agent"]
    # what the page was shown last is the text of the last agent turn, as generated
    assert streamed["partial"] == line["turns"][-1]["agent_text"]


def test_the_event_stream_follows_a_persons_turn_to_the_agents_answer(tiny_model_path, tmp_path):
    with running_chat(tiny_model_path, tmp_path / "out") as server:  # the scripted agent: no tokens to stream
        status, call = request(server, "POST", "/api/call", PROFILE)
        assert status == 200 and call["phase"] == "user" and call["streams"] is False
        seen, ready = [], threading.Event()
        reader = threading.Thread(target=_events, args=(server, seen, ready), daemon=True)
        reader.start()
        assert ready.wait(30)
        status, after = request(server, "POST", "/api/turn", {"reply": "Who is this?", "state": PROFILE["profile"]
                                                              ["state"], "end": None})
        assert status == 200 and after["phase"] == "user"
        reader.join(30)
        assert not reader.is_alive()
        assert request(server, "GET", "/api/stream", token=None)[0] == 403
    assert seen[0] == ("status", 200, "text/event-stream; charset=utf-8")
    events = seen[1:]
    assert events[0]["phase"] == "user" and events[0]["agent_turns"] == 1  # the greeting turn waits for the person
    assert events[-1]["phase"] == "user" and events[-1]["agent_turns"] == 2  # ends with the agent's answer
    assert all(e["partial"] is None for e in seen[1:])


def test_the_partial_turn_restarts_with_a_retried_attempt_and_is_capped():
    """The text pieces since the last None are the turn so far (a retried endpoint request starts afresh); the page
    is shown at most MAX_PARTIAL_CHARS of it."""
    call = HumanCall.__new__(HumanCall)  # only what `_on_text` and `progress` touch
    call.changed, call.version, call.phase, call.agent_turns = threading.Condition(), 0, "agent", 0
    call.fresh, call.partial = True, ""
    for piece in ("Hel", "lo th", None, "Hello", " there", "."):
        call._on_text(piece)
    assert call.progress(0, 1)["partial"] == "Hello there." and call.version == 5
    call._on_text(None)
    call._on_text("x" * (MAX_PARTIAL_CHARS - 3))
    call._on_text("abcdef")
    call._on_text("more")
    assert call.partial == "x" * (MAX_PARTIAL_CHARS - 3) + "abc"
