"""The chat page in a real headless Chromium shows an endpoint agent's turn while it is being written: a loopback
endpoint streams the turn in pieces and holds after some of them until the test has seen them on the page; the
finished call's record equals the one of the same call with --no-stream, and the endpoint's key is on neither
page nor record. Skips with its reason without Chromium (tests/helpers/headless_chromium.py)."""
from __future__ import annotations

import threading

import pytest

from llm_agent.evaluation.human_calls import HUMAN_FILE

from tests.helpers.chat_fixtures import read_lines, request, running_chat, same_part
from tests.helpers.headless_chromium import require_browser, start_chromium
from tests.helpers.hostile_openai import HostileOpenAIServer

pytestmark = pytest.mark.processes

KEY = "sk-page-" + "z" * 24
PICKED = {"cooperation": 3, "emotion": 1, "trust": 2}
REPLIES = ("Yes, I run the place. What is it about?", "Fine, I will claim it now.")
HOLD = 3  # pieces the endpoint streams before it waits for the test


def _wait(driver, condition, what, timeout=30.0):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())
    except TimeoutException:
        pytest.fail(f"the page did not get to {what} in {timeout} s; it says {_text(driver, 'phase')!r} / "
                    f"{_text(driver, 'pending-agent')!r}")


def _text(driver, element_id):
    return driver.find_element("id", element_id).text


def _say(driver, text, button):
    box = driver.find_element("id", "reply")
    box.clear()
    box.send_keys(text)
    driver.find_element("id", button).click()


def _play_in_the_browser(browser, server, endpoint, pieces):
    """A call with the picked user: the greeting, a reply whose answer is watched while it is written, and a
    reply ending it as agreed. What the page showed while the endpoint held."""
    from selenium.webdriver.support.ui import Select

    browser.get(server.url)
    _wait(browser, lambda: _text(browser, "title").startswith("Talk to"), "its title")
    browser.find_element("css selector", "#pick summary").click()
    for dim, value in PICKED.items():
        Select(browser.find_element("id", f"pick-{dim}")).select_by_value(str(value))
    Select(browser.find_element("id", "pick-behaviors")).select_by_value("0")
    browser.find_element("id", "new-pick").click()
    _wait(browser, lambda: _text(browser, "phase").endswith("your turn"), "the greeting")
    gate = threading.Event()
    endpoint.stream_in(pieces, hold=HOLD, gate=gate)
    _say(browser, REPLIES[0], "send")
    shown = "".join(pieces[:HOLD])
    try:
        assert endpoint.held.wait(30), "the endpoint got no streamed request"
        _wait(browser, lambda: _text(browser, "pending-agent") == shown.strip(), "the first pieces of the turn")
        seen = (_text(browser, "phase"), _text(browser, "pending-agent"))
    finally:
        gate.set()
    _wait(browser, lambda: _text(browser, "phase").endswith("your turn"), "the whole second turn")
    _say(browser, REPLIES[1], "agreed")
    _wait(browser, lambda: browser.find_element("id", "result").is_displayed(), "the result")
    assert "Outcome: completed" in _text(browser, "result")
    assert KEY not in browser.page_source
    return seen


def _play_over_http(server, state):
    status, call = request(server, "POST", "/api/call", {"profile": {"state": PICKED, "behaviors": [0]}})
    assert status == 200 and call["phase"] == "user" and call["streams"] is False, call
    for reply, end in zip(REPLIES, (None, "agreed")):
        status, call = request(server, "POST", "/api/turn", {"reply": reply, "state": state, "end": end})
        assert status == 200, call
    assert call["phase"] == "done", call


def test_the_page_shows_an_endpoint_agents_turn_while_it_is_written(tiny_model_path, tmp_path, scenario,
                                                                     monkeypatch):
    require_browser()
    monkeypatch.setenv("SEAD_AGENT_API_KEY", KEY)
    words = "Thanks. I am calling from FoodLoop about your restaurant's free listing; it takes two minutes."
    content = scenario.format_agent_output(words, 0, 0, {d: 2 for d in scenario.dims})
    cut = [0, 7, 19, len(content) // 2, len(content) - 9, len(content)]  # pieces of uneven size
    pieces = [content[a:b] for a, b in zip(cut, cut[1:])]
    assert "".join(pieces) == content and len(pieces) > HOLD
    browser = start_chromium(tmp_path / "profile")
    try:
        with HostileOpenAIServer("ok", content=content, api_key=KEY) as endpoint:
            endpoint.stream_in(pieces)
            with running_chat(tiny_model_path, tmp_path / "streamed", agent=endpoint.url) as server:
                phase, partial = _play_in_the_browser(browser, server, endpoint, pieces)
            assert (endpoint.requests, endpoint.streamed) == (2, 2)  # greeting and answer, both streamed
            with running_chat(tiny_model_path, tmp_path / "plain", "--no-stream", agent=endpoint.url) as server:
                _play_over_http(server, PICKED)
            assert (endpoint.requests, endpoint.streamed) == (4, 2)
    finally:
        browser.quit()
    # while the endpoint held, the page showed the turn so far and the agent was still answering
    assert phase.endswith("the agent is answering…") and partial == "".join(pieces[:HOLD]).strip()
    assert partial != content.strip()
    streamed, plain = read_lines(tmp_path / "streamed" / HUMAN_FILE), read_lines(tmp_path / "plain" / HUMAN_FILE)
    assert len(streamed) == len(plain) == 1
    assert same_part(streamed[0]) == same_part(plain[0])
    assert [t["user_reply"] for t in streamed[0]["turns"]] == list(REPLIES)
    assert {k: streamed[0]["profile"][k] for k in PICKED} == PICKED
    assert streamed[0]["outcome"] == "completed"
    assert all(KEY not in (tmp_path / d / HUMAN_FILE).read_text() for d in ("streamed", "plain"))
