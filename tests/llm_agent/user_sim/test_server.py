"""The simulator server over real HTTP: the official `openai` client, malformed requests, auth and faults.

One module-scoped server (hf backend on the tiny model, an API key) runs as a subprocess on a free port and is
stopped by its PID; fault tests use in-process apps (error / garbage) or a second subprocess (hang).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from llm_agent.scenario import DEFAULT_SCENARIO_PATH
from llm_agent.user_sim.server.app import ServerConfig, build_app
from llm_agent.user_sim.server.faults import FaultConfig, FaultInjector
from llm_agent.user_sim.server.scripted import ScriptedPersonaBackend
from tests.helpers.profiles import profile3

REPO_ROOT = Path(__file__).resolve().parents[3]
SCENARIO_PATH = DEFAULT_SCENARIO_PATH
API_KEY = "sk-test-key"
MODEL = "user-sim"
pytestmark = pytest.mark.processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None
                  ) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "llm_agent.user_sim.server", "--port", str(port), *args],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    _stop(proc)
    raise RuntimeError(f"server not healthy within 60 s:\n{log_path.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, 15)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, 9)
        proc.wait(timeout=5)


@pytest.fixture(scope="module")
def hf_server(tiny_model_path, tmp_path_factory):
    """Base URL of an hf-backend server on the tiny model that requires API_KEY."""
    log = tmp_path_factory.mktemp("hf_server") / "server.log"
    proc, url = _start_server(["--backend", "hf", "--model", tiny_model_path, "--served-model-name", MODEL], log,
                              env={"SEAD_USER_SIM_API_KEY": API_KEY})
    yield url
    _stop(proc)
    assert proc.returncode is not None


@pytest.fixture(scope="module")
def client(hf_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{hf_server}/v1", api_key=API_KEY, timeout=60, max_retries=0)


MESSAGES = [{"role": "system", "content": "You are a busy restaurant owner."},
            {"role": "user", "content": "Hello, this is Mia from Dishly."}]


def test_chat_completion_with_openai_client(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.7, seed=1)
    assert out.object == "chat.completion" and out.model == MODEL
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens > 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_vanishing_temperature_is_greedy_not_a_500(client):
    """Both used to be HTTP 500: temperature=1e-300 (the scaled logits overflow and torch.multinomial fails) and
    n > 1 at temperature 0 (generate() refuses several greedy sequences)."""
    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.0, n=3)
    assert len({c.message.content for c in greedy.choices}) == 1 and len(greedy.choices) == 3
    tiny = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1e-300, n=2,
                                          seed=3)
    assert [c.message.content for c in tiny.choices] == [greedy.choices[0].message.content] * 2


def test_n_choices_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.95, n=3, seed=7)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1, "three sampled choices of a random model should differ"
    greedy = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=6,
                                             temperature=0).choices[0].message.content for _ in range(2)]
    assert greedy[0] == greedy[1]


def test_concurrent_seeded_requests_match_sequential_ones(client, hf_server):
    import asyncio

    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0)
    sequential = [client.chat.completions.create(seed=s, **kwargs).choices[0].message.content for s in range(8)]

    async def burst() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{hf_server}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=60) as aclient:
            outs = await asyncio.gather(*(aclient.chat.completions.create(seed=s, **kwargs) for s in range(8)))
        return [o.choices[0].message.content for o in outs]

    assert asyncio.run(burst()) == sequential, "generation under the lock is isolated per request"


def test_streaming_matches_shape(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, seed=3,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, seed=3)
    assert streamed == plain.choices[0].message.content


def test_models_list_and_health(client, hf_server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{hf_server}/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_wrong_or_missing_api_key_is_401(hf_server):
    bad = openai.OpenAI(base_url=f"{hf_server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{hf_server}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def _ok_body(**overrides) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **overrides}


MALFORMED = {
    "not_json": (b"{not json", 400),
    "invalid_utf8": (b"\xff\xfe\x00{", 400),
    "json_array": (b"[1, 2]", 400),
    "deep_nesting": (b"[" * 100_000 + b"]" * 100_000, 400),
    "missing_messages": (json.dumps({"model": MODEL}).encode(), 400),
    "empty_messages": (json.dumps(_ok_body(messages=[])).encode(), 400),
    "messages_not_list": (json.dumps(_ok_body(messages="hi")).encode(), 400),
    "message_not_object": (json.dumps(_ok_body(messages=["hi"])).encode(), 400),
    "bad_role": (json.dumps(_ok_body(messages=[{"role": "wizard", "content": "x"}])).encode(), 400),
    "content_number": (json.dumps(_ok_body(messages=[{"role": "user", "content": 5}])).encode(), 400),
    "content_bad_part": (json.dumps(_ok_body(messages=[{"role": "user", "content": [{"type": "image"}]}])).encode(),
                         400),
    "missing_model": (json.dumps({"messages": MESSAGES}).encode(), 400),
    "unknown_model": (json.dumps(_ok_body(model="gpt-x")).encode(), 404),
    "n_zero": (json.dumps(_ok_body(n=0)).encode(), 400),
    "n_too_big": (json.dumps(_ok_body(n=129)).encode(), 400),
    "n_string": (json.dumps(_ok_body(n="2")).encode(), 400),
    "n_bool": (json.dumps(_ok_body(n=True)).encode(), 400),
    "temperature_high": (json.dumps(_ok_body(temperature=2.5)).encode(), 400),
    "temperature_nan": (b'{"model": "user-sim", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
                        400),
    "top_p_zero": (json.dumps(_ok_body(top_p=0)).encode(), 400),
    "max_tokens_zero": (json.dumps(_ok_body(max_tokens=0)).encode(), 400),
    "max_tokens_float": (json.dumps(_ok_body(max_tokens=2.5)).encode(), 400),
    "seed_string": (json.dumps(_ok_body(seed="x")).encode(), 400),
    "seed_too_big": (json.dumps(_ok_body(seed=2 ** 64)).encode(), 400),  # torch.manual_seed would raise
    "temperature_huge_int": (json.dumps(_ok_body(temperature=10 ** 400)).encode(), 400),  # float() overflows
    "top_p_huge_negative_int": (json.dumps(_ok_body(top_p=-10 ** 400)).encode(), 400),
    "content_lone_surrogate": (json.dumps(_ok_body(messages=[{"role": "user", "content": "hi \ud800"}])).encode(),
                               400),
    "model_lone_surrogate": (json.dumps(_ok_body(model="user-sim\ud800")).encode(), 400),
    "stop_lone_surrogate": (json.dumps(_ok_body(stop=["\udfff"])).encode(), 400),
    "stop_too_many": (json.dumps(_ok_body(stop=["a", "b", "c", "d", "e"])).encode(), 400),
    "too_large": (json.dumps(_ok_body(messages=[{"role": "user", "content": "x" * (1 << 20)}])).encode(), 413),
    "prompt_over_context": (json.dumps(_ok_body(messages=[{"role": "user", "content": "hello " * 5000}])).encode(),
                            400),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_gets_4xx_json(hf_server, case):
    body, expected = MALFORMED[case]
    r = httpx.post(f"{hf_server}/v1/chat/completions", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == expected, r.text[:300]
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")


def test_wrong_method_and_unknown_path_are_4xx_json(hf_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{hf_server}/v1/chat/completions", headers=headers, timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(f"{hf_server}/v1/nothing", headers=headers, timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{hf_server}/health", timeout=5).status_code == 200, "the server survived every bad request"


def test_lognormal_latency_has_the_configured_median_and_sigma():
    injector = FaultInjector(FaultConfig(latency_median_ms=40.0, latency_sigma=0.8, seed=3))
    draws = [injector.sample_latency_s() for _ in range(20_000)]
    assert statistics.median(draws) == pytest.approx(0.040, rel=0.05)
    logs = [__import__("math").log(d) for d in draws]
    assert statistics.pstdev(logs) == pytest.approx(0.8, rel=0.05)
    assert max(draws) > 5 * 0.040, "heavy right tail"
    assert FaultInjector(FaultConfig()).sample_latency_s() == 0.0


def test_fault_config_rejects_bad_values():
    with pytest.raises(ValueError, match="inject-fault"):
        FaultConfig(fault="explode")
    with pytest.raises(ValueError, match="fault-rate"):
        FaultConfig(fault="error", fault_rate=1.5)
    with pytest.raises(ValueError, match="latency"):
        FaultConfig(latency_median_ms=-1)


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    """Base URL of a scripted-backend server (no API key) on the shipped scenario."""
    log = tmp_path_factory.mktemp("scripted_server") / "server.log"
    proc, url = _start_server(["--backend", "scripted", "--scenario", str(SCENARIO_PATH)], log)
    yield url
    _stop(proc)


def _persona_messages(scenario, agent_text: str) -> list[dict]:
    turn = scenario.parse_agent_output(scenario.format_agent_output(agent_text, 0, 0, {}))
    return scenario.render_user_messages(profile3(2, 2, 2, scenario.behaviors[:1]), [turn])


def test_scripted_server_answers_in_the_user_tag_protocol(scripted_server, scenario):
    client = openai.OpenAI(base_url=f"{scripted_server}/v1", api_key="EMPTY", max_retries=0, timeout=30)
    intro = "Hi, my name is Mia, calling from FoodLoop. Am I speaking with the manager?"
    kwargs = dict(model=MODEL, messages=_persona_messages(scenario, intro), n=3, seed=4, temperature=1.0)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    parsed = [scenario.parse_user_output(c.message.content) for c in first.choices]
    assert all(p.well_formed and p.status == 0 for p in parsed)
    assert len({(p.state["cooperation"], p.state["emotion"], p.state["trust"]) for p in parsed}) == 1
    doubt_lines = scenario.scripted.categories[scenario.behaviors[0].category].doubt
    assert any(d in parsed[0].reply for d in doubt_lines), "the profile's first behaviour is raised"
    nobody = client.chat.completions.create(model=MODEL, messages=_persona_messages(scenario, "Hello there."))
    assert scenario.parse_user_output(nobody.choices[0].message.content).reply in scenario.scripted.lines["ask_who"]


def test_stop_strings_cut_the_reply(scripted_server, scenario):
    client = openai.OpenAI(base_url=f"{scripted_server}/v1", api_key="EMPTY", max_retries=0, timeout=30)
    reply_tag = scenario.user_tags.tag("reply")
    out = client.chat.completions.create(model=MODEL, messages=_persona_messages(scenario, "Hello there."),
                                         stop=[f"</{reply_tag}>"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.rstrip().endswith(
        scenario.parse_user_output(out.choices[0].message.content + f"</{reply_tag}>").reply)
    assert f"</{reply_tag}>" not in out.choices[0].message.content


def test_scripted_backend_answers_lone_surrogates_and_huge_numbers_with_400(scenario):
    """Bodies that used to reach the scripted backend (or float()) and come back as 500."""
    from fastapi.testclient import TestClient

    messages = _persona_messages(scenario, "Hi")
    bad = [{"model": MODEL, "messages": [messages[0], {"role": "user", "content": "hi \ud800"}]},
           {"model": MODEL, "messages": [{**messages[0], "content": messages[0]["content"] + "\udc80"}, messages[1]]},
           {"model": MODEL, "messages": messages, "temperature": 10 ** 400}]
    with TestClient(build_app(ScriptedPersonaBackend(scenario), ServerConfig()),
                    raise_server_exceptions=False) as tc:
        for body in bad:
            r = tc.post("/v1/chat/completions", content=json.dumps(body).encode(),
                        headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text[:300]
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert tc.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).status_code == 200
        huge = scenario.format_user_output("Sure.", {"cooperation": 1, "emotion": 1, "trust": 1}, 0).replace(
            "<user_trust>1<", "<user_trust>" + "9" * 5000 + "<")
        follow_up = [*messages, {"role": "assistant", "content": huge}, {"role": "user", "content": "Hello?"}]
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": follow_up})
        assert r.status_code == 200, "a 5000-digit state in an earlier reply is clamped, not a crash"


def test_scripted_server_rejects_a_foreign_conversation_with_400(scripted_server):
    r = httpx.post(f"{scripted_server}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "system", "content": "You are a pirate."},
                                     {"role": "user", "content": "Ahoy"}]})
    assert r.status_code == 400 and "persona" in r.json()["error"]["message"]


def _fault_client(scenario, **faults) -> "TestClient":
    from fastapi.testclient import TestClient

    config = ServerConfig(faults=FaultConfig(**faults))
    return TestClient(build_app(ScriptedPersonaBackend(scenario), config))


def test_injected_error_fault_is_503_in_openai_shape(scenario):
    with _fault_client(scenario, fault="error") as tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": _persona_messages(scenario, "Hi")})
    assert r.status_code == 503 and r.json()["error"]["code"] == "injected_fault"


def test_injected_garbage_is_200_but_not_a_chat_completion(scenario):
    with _fault_client(scenario, fault="garbage") as tc:
        bodies = [tc.post("/v1/chat/completions", json={"model": MODEL,
                                                        "messages": _persona_messages(scenario, "Hi")})
                  for _ in range(2)]
    assert all(r.status_code == 200 for r in bodies)
    with pytest.raises(ValueError):
        json.loads(bodies[0].content)
    assert not isinstance(json.loads(bodies[1].content)["choices"], list)


def test_injected_latency_and_partial_fault_rate(scenario):
    body = {"model": MODEL, "messages": _persona_messages(scenario, "Hi")}
    with _fault_client(scenario, latency_median_ms=150.0, latency_sigma=0.0) as tc:
        start = time.monotonic()
        assert tc.post("/v1/chat/completions", json=body).status_code == 200
        assert time.monotonic() - start >= 0.15
    with _fault_client(scenario, fault="error", fault_rate=0.5, seed=1) as tc:
        codes = [tc.post("/v1/chat/completions", json=body).status_code for _ in range(40)]
    assert set(codes) == {200, 503} and 8 <= codes.count(503) <= 32


def test_injected_hang_times_out_the_client_and_the_server_still_stops(tmp_path, scenario):
    proc, url = _start_server(["--backend", "scripted", "--inject-fault", "hang"], tmp_path / "hang.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=1.5)
        start = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model=MODEL, messages=_persona_messages(scenario, "Hi"))
        assert time.monotonic() - start < 5
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        start = time.monotonic()
        _stop(proc)
    assert time.monotonic() - start < 10, "a hanging request must not block shutdown"
