"""The talk-to-the-agent page in a real headless Chromium: refused without its token, a whole call played with a
hand-picked user and ended as agreed, the record on disk and its completion metric, markup inert in every field the
page shows (a scenario whose agent words, behaviour and doubt carry XSS payloads, and the person's own words), and
the report of an evaluation with two human calls beside it. Skips with its reason without Chromium (see
tests/helpers/headless_chromium.py)."""
from __future__ import annotations

import json

import pytest
import yaml

from llm_agent.evaluation.human_calls import HUMAN_FILE
from llm_agent.evaluation.report import build_report
from llm_agent.evaluation.run_data import read_dialogues, resolve_run
from llm_agent.evaluation.runner import EvalSettings, evaluate_agent
from llm_agent.metrics import dialogue_metrics
from llm_agent.scenario import load_scenario
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from utils.create_prompt_data import create_prompt_data

from tests.helpers.chat_fixtures import read_lines, running_chat
from tests.helpers.headless_chromium import require_browser, start_chromium
from tests.helpers.repo import SCENARIO_PATH

pytestmark = pytest.mark.processes

AGENT_XSS = 'merchant <img src=x onerror="window.__xss=1"> team'
BEHAVIOR_XSS = 'Asks <script>window.__xss=2</script> twice.'
DOUBT_XSS = '<svg onload="window.__xss=3">Is this real?'
REPLIES = ('Yes, <b>I</b> run the place. <img src=x onerror="window.__xss=4">',
           '</script><script>window.__xss=5</script> Okay, done, I claimed it.')


def _hostile_scenario(tmp_path):
    """The default scenario with payloads in the words the scripted agent says (its organisation cue), one
    behaviour (last in the library) and its doubt."""
    data = yaml.safe_load(SCENARIO_PATH.read_text())
    library = (SCENARIO_PATH.parent / data["behavior_library"]).resolve().read_text().splitlines()
    library.append(json.dumps({"category": "testing", "behavior": BEHAVIOR_XSS}))
    (tmp_path / "library.jsonl").write_text("\n".join(library) + "\n")
    data["behavior_library"] = "library.jsonl"
    data["scripted"]["cues"]["organisation"] = [AGENT_XSS]
    data["scripted"]["categories"]["testing"]["doubt"] = [DOUBT_XSS]
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, len(library) - 1


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    require_browser()
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def evaluated(tiny_model_path, tmp_path_factory):
    """An evaluation of the scripted agent (3 dialogues against the in-process persona) and its directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    scenario = load_scenario(SCENARIO_PATH)
    out = tmp_path_factory.mktemp("eval")
    test_file = str(create_prompt_data(SCENARIO_PATH, out / "data", train_samples=1, test_samples=3, seed=3)["test"])
    settings = EvalSettings(scenario=str(SCENARIO_PATH), test_file=test_file, max_dialogues=3, max_turns=8)
    evaluate_agent("rl", ScriptedPolicyWorkerGroup(tok, scenario, world_size=1, quality="good"), tok, settings, out,
                   client=InProcessUserSim(scenario), n_resamples=10)
    return out


def _wait(driver, condition, what, timeout=60.0):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())
    except TimeoutException:
        pytest.fail(f"the page did not get to {what} in {timeout} s; it says {driver.find_element('id', 'phase').text!r}"
                    f" / error {driver.find_element('id', 'error').text!r}")


def _phase(driver):
    return driver.find_element("id", "phase").text


def _say(driver, text, button):
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "reply")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, button).click()


def _inert(driver):
    """No payload ran and none became an element."""
    assert driver.execute_script("return window.__xss === undefined"), "a payload ran"
    assert not driver.find_elements("css selector", "main img, main svg, aside img, aside svg, main b, aside b")
    assert len(driver.find_elements("css selector", "script")) == 1


def test_a_call_played_in_the_browser(browser, tiny_model_path, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    scenario_path, xss_index = _hostile_scenario(tmp_path)
    out = tmp_path / "out"
    with running_chat(tiny_model_path, out, "--scenario", str(scenario_path)) as server:
        browser.get(server.url.split("?")[0])
        assert "valid access token" in browser.find_element(By.TAG_NAME, "body").text
        browser.get(server.url)
        _wait(browser, lambda: browser.find_element(By.ID, "title").text.startswith("Talk to"), "its title")
        # a hand-picked user: initial state and two behaviours, one of them hostile
        picked = {"cooperation": 3, "emotion": 1, "trust": 2}
        browser.find_element(By.CSS_SELECTOR, "#pick summary").click()
        for dim, value in picked.items():
            Select(browser.find_element(By.ID, f"pick-{dim}")).select_by_value(str(value))
        behaviors = Select(browser.find_element(By.ID, "pick-behaviors"))
        behaviors.select_by_value("0")
        behaviors.select_by_value(str(xss_index))
        browser.find_element(By.ID, "new-pick").click()
        _wait(browser, lambda: _phase(browser).endswith("your turn"), "the first agent turn")
        card = browser.find_element(By.TAG_NAME, "aside").text
        assert BEHAVIOR_XSS in card and DOUBT_XSS in browser.find_element(By.ID, "card-doubts").text
        assert "cooperation 3, emotion 1, trust 2" in card
        assert AGENT_XSS in browser.find_element(By.ID, "pending-agent").text
        assert browser.find_element(By.ID, "scripted").text.startswith("scripted persona would say:")
        _inert(browser)
        # two turns: the second reports another state and ends the call as agreed
        _say(browser, REPLIES[0], "send")
        _wait(browser, lambda: len(browser.find_elements(By.CSS_SELECTOR, "#dialogue .turn")) == 1
              and _phase(browser).endswith("your turn"), "the second agent turn")
        Select(browser.find_element(By.ID, "state-trust")).select_by_value("4")
        _say(browser, REPLIES[1], "agreed")
        _wait(browser, lambda: browser.find_element(By.ID, "result").is_displayed(), "the result")
        assert "Outcome: completed" in browser.find_element(By.ID, "result").text
        assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#dialogue .user")] == list(REPLIES)
        _inert(browser)
    line = read_lines(out / HUMAN_FILE)[-1]
    assert line["judge"] == "human" and line["outcome"] == "completed"
    assert {k: line["profile"][k] for k in picked} == picked
    assert [b["behavior"] for b in line["profile"]["behaviors"]][-1] == BEHAVIOR_XSS
    assert [t["user_reply"] for t in line["turns"]] == list(REPLIES)
    assert [t["user_state"]["trust"] for t in line["turns"]] == [2, 4] and line["turns"][-1]["user_status"] == 1
    assert dialogue_metrics(read_dialogues(out / HUMAN_FILE), load_scenario(scenario_path))[
        "completion_rate"] == 1.0


def test_the_report_shows_human_calls_beside_the_evaluation(browser, evaluated, tiny_model_path, scenario):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from tests.helpers.chat_fixtures import request

    with running_chat(tiny_model_path, evaluated) as server:
        for end in ("agreed", "hung_up"):
            status, call = request(server, "POST", "/api/call", {"profile": "sample"})
            assert status == 200
            status, call = request(server, "POST", "/api/turn", {"reply": "<i>fine</i>", "state": call["card"]["state"],
                                                                 "end": end})
            assert status == 200 and call["phase"] == "done"
    human = read_lines(evaluated / HUMAN_FILE)
    simulated = read_lines(evaluated / "rl_dialogues.jsonl")
    assert len(human) == 2 and len(simulated) == 3
    path = build_report(resolve_run(evaluated / "rl_dialogues.jsonl"), scenario, evaluated / "report.html",
                        bootstrap=0)
    browser.get(path.as_uri())
    _wait(browser, lambda: browser.find_element(By.ID, "count").text.startswith("Showing"), "the browser's rows")
    options = {o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#f-split option")}
    assert {"eval", "eval@human"} <= options
    Select(browser.find_element(By.ID, "f-split")).select_by_value("eval@human")
    _wait(browser, lambda: browser.find_element(By.ID, "count").get_attribute("data-matches") == "2", "2 human calls")
    ids = [tr.find_element(By.TAG_NAME, "td").text for tr in browser.find_elements(By.CSS_SELECTOR, "#dlg-rows tr")]
    assert sorted(ids) == sorted(d["dialogue_id"] for d in human)
    Select(browser.find_element(By.ID, "f-split")).select_by_value("eval")
    _wait(browser, lambda: browser.find_element(By.ID, "count").get_attribute("data-matches") == "3", "3 simulated")
    assert "eval@human" in browser.find_element(By.ID, "metrics").text
    assert not browser.find_elements(By.CSS_SELECTOR, "#dlg-rows i")
