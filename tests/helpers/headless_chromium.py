"""Headless Chromium for the browser tests (Debian's chromium + chromium-driver, driven by selenium): the skip when
one is missing, and a driver with a fresh profile and no background network traffic."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("SEAD_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SEAD_CHROMEDRIVER", "/usr/bin/chromedriver")


def require_browser() -> None:
    """Skip with the reason when Chromium, its driver or selenium is missing."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)) and shutil.which(path) is None:
            pytest.skip(f"{path} not found: install Debian's {package} (apt-get install -y chromium chromium-driver)")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")


def start_chromium(profile_dir: Path) -> Any:
    """A headless Chromium driver using `profile_dir` as its fresh profile (quit it when done)."""
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000", f"--user-data-dir={profile_dir}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(120)
    return driver
