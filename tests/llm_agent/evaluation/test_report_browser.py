"""The report's dialogue browser in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): 10,000 synthetic dialogues, filters, search, paging, a transcript and a screenshot.

Expected counts and ids are computed here in Python from the fixture, not by the page's code. Skips with its
reason when Chromium, its driver or selenium is missing (`.ci/run` installs Chromium with apt-get).
"""
from __future__ import annotations

import json
import logging
import time

import pytest
from PIL import Image

from llm_agent.evaluation.report import build_report
from llm_agent.evaluation.run_data import resolve_run

from tests.helpers.headless_chromium import require_browser, start_chromium
from tests.helpers.report_fixtures import SEARCH_WORD, synthetic_dialogues

N_DIALOGUES = 10_000
PAGE_SIZE = 50
logger = logging.getLogger(__name__)

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def big_report(tmp_path_factory, scenario):
    """A report over 10,000 synthetic dialogues (a rollout log of 10 steps) and the dialogues themselves."""
    require_browser()
    root = tmp_path_factory.mktemp("browser")
    dialogues = synthetic_dialogues(scenario, N_DIALOGUES, seed=7, steps=10)
    log = root / "rollouts" / "big" / "rollouts.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    started = time.perf_counter()
    path = build_report(resolve_run(log), scenario, root / "big.html", bootstrap=0)
    logger.info("report of %d dialogues: %.1f s, %.1f MB", N_DIALOGUES, time.perf_counter() - started,
                path.stat().st_size / 1e6)
    return path, dialogues


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium with a fresh profile and no background network traffic."""
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


def _wait(driver, condition, timeout=30.0):
    """Wait for `condition()`; on timeout fail with what the page's count line says."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())
    except TimeoutException:
        pytest.fail(f"the page did not get there in {timeout} s; its count line says: "
                    f"{driver.find_element('id', 'count').text!r}")


def _rows(driver):
    from selenium.webdriver.common.by import By

    return [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in driver.find_elements(By.CSS_SELECTOR, "#dlg-rows tr")]


def _click(driver, element) -> None:
    """Scroll `element` to the middle of the window (clear of the sticky nav), as a user would, and click it."""
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
    element.click()


def _matches(driver) -> int:
    return int(driver.find_element("id", "count").get_attribute("data-matches"))


def _user_text(d) -> str:
    return " ".join((t["user_reply"] or "") for t in d["turns"]).lower()


def _check_headline(browser, dialogues):
    """The page opens with CR before -> after training (first and last validation) and the change; this page is
    built with the bootstrap off, so the headline says it has no interval (the intervals are the report tests')."""
    from selenium.webdriver.common.by import By

    headline = browser.find_element(By.ID, "headline")
    assert headline.is_displayed() and headline.location["y"] < 300, "the headline is at the top of the page"
    val_steps = sorted({d["step"] for d in dialogues if d["split"] == "val"})
    expected = []
    for when, step in (("before", val_steps[0]), ("after", val_steps[-1])):
        scored = [d for d in dialogues if d["split"] == "val" and d["step"] == step and d["outcome"] != "error"]
        k = sum(d["outcome"] == "completed" for d in scored)
        expected.append((k / len(scored), f"{when}: val, step {step} {k / len(scored):.3f}, {k}/{len(scored)}"))
    change = expected[1][0] - expected[0][0]
    text = headline.text
    assert text.startswith(f"Completion rate (CR): {expected[0][1]} \u2192 {expected[1][1]} ({change:+.3f})"), text
    assert "no interval (bootstrap off)" in text


@pytest.mark.extended  # 50 s measured with its report: make test-extended (CI), out of make test's 20 minutes
def test_browser_filters_searches_and_shows_a_transcript(big_report, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    path, dialogues = big_report
    started = time.perf_counter()
    browser.get(path.as_uri())
    _wait(browser, lambda: browser.find_element(By.ID, "count").text.startswith("Showing"))
    load_s = time.perf_counter() - started
    assert _matches(browser) == N_DIALOGUES
    assert len(_rows(browser)) == PAGE_SIZE
    assert f"of {N_DIALOGUES} matching" in browser.find_element(By.ID, "count").text
    _check_headline(browser, dialogues)

    # a filter: completed validation dialogues
    started = time.perf_counter()
    Select(browser.find_element(By.ID, "f-outcome")).select_by_value("completed")
    Select(browser.find_element(By.ID, "f-split")).select_by_value("val")
    expected = [d for d in dialogues if d["outcome"] == "completed" and d["split"] == "val"]
    _wait(browser, lambda: _matches(browser) == len(expected))
    filter_s = time.perf_counter() - started
    rows = _rows(browser)
    assert len(rows) == min(PAGE_SIZE, len(expected))
    assert [r[0] for r in rows] == [d["dialogue_id"] for d in expected[:PAGE_SIZE]]
    assert all(r[2] == "val" and r[3] == "completed" for r in rows)

    # full-text search on top of the filter
    browser.find_element(By.ID, "f-search").send_keys(SEARCH_WORD.upper())
    found = [d for d in expected if SEARCH_WORD in _user_text(d)]
    assert found, "the fixture must have completed validation dialogues that mention the search word"
    _wait(browser, lambda: _matches(browser) == len(found))
    assert [r[0] for r in _rows(browser)] == [d["dialogue_id"] for d in found[:PAGE_SIZE]]

    # the transcript of the first hit: every turn, both sides, cache hits and the reward components
    _click(browser, browser.find_element(By.CSS_SELECTOR, "#dlg-rows tr"))
    panel = browser.find_element(By.ID, "transcript")
    _wait(browser, panel.is_displayed)
    first = found[0]
    assert first["dialogue_id"] in panel.find_element(By.TAG_NAME, "h3").text
    turns = panel.find_elements(By.CSS_SELECTOR, ".turn")
    assert len(turns) == len(first["turns"])
    for view, turn in zip(turns, first["turns"]):
        user_side = view.find_element(By.CSS_SELECTOR, ".side.user")
        assert ("cache hit" in user_side.text) == (turn["user_source"] == "cache")
        assert turn["user_reply"] in user_side.text
        if turn["agent_format_ok"]:
            stage = scenario_stage_name(browser, turn["agent_stage"])
            assert stage in view.find_element(By.CSS_SELECTOR, ".side.agent").text
    assert SEARCH_WORD in panel.text
    assert "completion" in panel.text and f"{first['reward']:.3f}" in panel.text
    assert "selected" in browser.find_element(By.CSS_SELECTOR, "#dlg-rows tr").get_attribute("class")

    # reset, then a step range and an initial-state value; then paging
    _click(browser, browser.find_element(By.ID, "f-reset"))
    _wait(browser, lambda: _matches(browser) == N_DIALOGUES)
    browser.find_element(By.ID, "f-step-min").send_keys("3", Keys.TAB)
    browser.find_element(By.ID, "f-step-max").send_keys("4", Keys.TAB)
    Select(browser.find_element(By.ID, "f-cooperation")).select_by_value("2")
    expected = [d for d in dialogues if 3 <= d["step"] <= 4 and d["profile"]["cooperation"] == 2]
    _wait(browser, lambda: _matches(browser) == len(expected))
    _click(browser, browser.find_element(By.ID, "next"))
    _wait(browser, lambda: browser.find_element(By.ID, "count").text.startswith(f"Showing {PAGE_SIZE + 1}–"))
    assert [r[0] for r in _rows(browser)] == [d["dialogue_id"] for d in expected[PAGE_SIZE:2 * PAGE_SIZE]]

    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(shot) as im:
        assert im.size[0] >= 1000 and im.size[1] >= 500
    print(f"\n10k-dialogue report: page ready in {load_s:.2f} s, outcome+split filter in {filter_s:.2f} s")


def scenario_stage_name(browser, stage_id) -> str:
    """The stage's name as the page's embedded data has it (so the check reads what the page shows)."""
    data = json.loads(browser.find_element("id", "dialogue-data").get_attribute("textContent"))
    return data["stages"][str(stage_id)]
