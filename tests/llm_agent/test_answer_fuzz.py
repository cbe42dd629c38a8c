"""Property-based fuzzing of the answer side (issue 29): what simulators and OpenAI-compatible endpoints send
back, decoded by the simulator client's wire functions, the endpoint helper every OpenAI-style caller uses (the
profile writer's source, the evaluation's endpoint agent) and the profile writer's answer check. Seeds: the probes
of the issue (deep nesting in a 200, a 503 and `/v1/models`, lone surrogates, NaN). Properties: the only failure
is the caller's own error type, every text that comes out is encodable UTF-8, and an accepted profile keeps the
asked-for state and behaviour bounds."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llm_agent.openai_endpoint import EndpointError, OpenAIEndpoint
from llm_agent.profiles.answers import check_answer
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.client.http_pool import HTTPReply
from llm_agent.user_sim.client.wire import AttemptError, completion_text, raise_for_status, served_model_ids

from tests.helpers.hostile_json import (NESTED_PROBES, completion_body, dumps, hostile_text, json_values, nested_json,
                                       reply_bodies)
from tests.helpers.hostile_openai import HostileOpenAIServer

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STATUSES = st.sampled_from([200, 200, 200, 400, 408, 429, 500, 503])
ATTEMPT_KINDS = {"overloaded", "http", "rejected", "garbage"}
ENDPOINT_KINDS = {"http", "rejected", "garbage", "too_large", "timeout", "connection"}
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
STATE = (2, 1, 3)


def _utf8(text: str) -> bool:
    text.encode("utf-8")  # raises on a lone surrogate
    return True


@FUZZ
@given(status=STATUSES, body=reply_bodies())
@example(status=200, body=NESTED_PROBES[0]).via("issue 29 item 1: nested 200")
@example(status=503, body=NESTED_PROBES[1]).via("issue 29 item 1: nested 503")
@example(status=200, body=completion_body("hi \ud800")).via("issue 29 item 2: a lone surrogate")
@example(status=200, body=b'{"choices": [{"message": {"content": NaN}}]}').via("NaN content")
def test_a_simulator_reply_is_text_or_an_attempt_error(status, body):
    reply = HTTPReply(status, body, "POST", "/v1/chat/completions")
    try:
        raise_for_status(reply)
        text = completion_text(reply)
    except AttemptError as err:
        assert err.kind in ATTEMPT_KINDS and _utf8(str(err))
    else:
        assert status == 200 and _utf8(text)
    try:
        models = served_model_ids(HTTPReply(200, body, "GET", "/v1/models"))
    except AttemptError as err:
        assert err.kind == "garbage" and _utf8(str(err))
    else:
        assert all(isinstance(m, str) and _utf8(m) for m in models)


@pytest.fixture(scope="module")
def endpoint_server():
    with HostileOpenAIServer("raw") as server:
        endpoint = OpenAIEndpoint(server.url, timeout_s=5, max_reply_bytes=1 << 16)
        yield server, endpoint
        endpoint.close()


@FUZZ
@given(status=STATUSES, body=reply_bodies())
@example(status=200, body=NESTED_PROBES[0]).via("issue 29 item 4: a nested answer")
@example(status=200, body=completion_body(None)).via("null content")
def test_an_endpoint_answer_is_text_or_an_endpoint_error(endpoint_server, status, body):
    server, endpoint = endpoint_server
    server.answer_with(status, body)
    try:
        content, finish = endpoint.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    except EndpointError as err:
        assert err.kind in ENDPOINT_KINDS and _utf8(str(err))
        if status == 200 and len(body) > 1 << 16:
            assert err.kind == "too_large"
    else:
        assert status == 200 and _utf8(content) and _utf8(finish)


def _profile_answers() -> st.SearchStrategy[str]:
    """Answers of a profile-writing LLM: anything, or an object with a `behaviors` list of library numbers, library
    texts and hostile values, maybe fenced or surrounded by prose."""
    texts = st.sampled_from([b.behavior for b in SCENARIO.behaviors])
    items = st.one_of(st.integers(-2, len(SCENARIO.behaviors) + 2), texts, texts.map(lambda t: {"behavior": t}),
                      json_values(4), hostile_text())
    shaped = st.fixed_dictionaries({"behaviors": st.lists(items, max_size=6)}, optional={
        "cooperation": json_values(2), "reason": hostile_text()}).map(lambda v: dumps(v).decode())
    wrapped = st.tuples(hostile_text(8), shaped, hostile_text(8)).map(lambda p: f"{p[0]}```json\n{p[1]}\n```{p[2]}")
    return st.one_of(hostile_text(64), json_values().map(lambda v: dumps(v).decode()), shaped, wrapped,
                     nested_json().map(bytes.decode))


@FUZZ
@given(text=_profile_answers(), low=st.integers(0, 2), extra=st.integers(0, 2))
@example(text=NESTED_PROBES[1].decode(), low=0, extra=3).via("issue 29 item 4: a nested answer")
@example(text='{"behaviors": ["\ud800"]}', low=0, extra=3).via("a lone surrogate")
@example(text='{"behaviors": ["\u00b2", "%s"]}' % ("9" * 5000), low=0, extra=3).via("digits int() refuses")
def test_a_profile_answer_is_checked_without_raising(text, low, extra):
    check = check_answer(text, dict(zip(SCENARIO.dims, STATE)), SCENARIO.behaviors, low, low + extra)
    assert check.accepted != (check.reject_reason is not None) and _utf8(check.detail)
    if check.accepted:
        profile = check.profile
        assert (profile.state["cooperation"], profile.state["emotion"], profile.state["trust"]) == STATE
        assert low <= len(profile.behaviors) <= low + extra
        assert set(profile.behaviors) <= set(SCENARIO.behaviors)
