"""The explorer (``cacheblend ui``) in a real browser: headless Chromium through Selenium
(Debian's chromium + chromium-driver, installed by scripts/ensure-chromium.sh)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ui_url(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("ui") / "ui.log"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "-m", "cacheblend.cli", "ui", "--port", str(port), "--store", "memory"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(1)
    else:
        pytest.fail("cacheblend ui did not answer: " + log.read_text()[-3000:])
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail("chromium and chromedriver are not installed (make test installs them: scripts/ensure-chromium.sh)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1300"):
        options.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=options)
    yield b
    b.quit()


def _value(browser, css: str) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, css).get_attribute("value") or ""


def _tab(browser, wait, name: str, button: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.XPATH, f"//button[@role='tab' and contains(., '{name}')]").click()
    wait.until(lambda b: b.find_element(By.CSS_SELECTOR, button).is_displayed())
    browser.find_element(By.CSS_SELECTOR, button).click()


def test_every_tab_in_a_real_browser(ui_url, browser, tmp_path):
    """Ask (both answers streamed, with TTFT), Tokens (a non-empty token map with
    recomputed tokens), Attention and Speed (their figures); screenshots of each go to
    $CACHEBLEND_UI_SCREENSHOTS (docs/img) when set."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    shots = Path(os.environ.get("CACHEBLEND_UI_SCREENSHOTS", tmp_path))
    wait = WebDriverWait(browser, 300, poll_frequency=0.5)
    browser.get(ui_url)
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#ask"))
    question = browser.find_element(By.CSS_SELECTOR, "#question textarea, #question input")
    question.clear()
    question.send_keys("Where did Ida Haendel live later in life?")
    browser.find_element(By.CSS_SELECTOR, "#ask").click()
    wait.until(lambda b: _value(b, "#answer-full textarea").strip() and _value(b, "#answer-method textarea").strip()
               and b.find_element(By.CSS_SELECTOR, "#ask-stats").text.count("TTFT") == 2)
    stats = browser.find_element(By.CSS_SELECTOR, "#ask-stats").text
    assert "full" in stats and "blend" in stats and "recomputed" in stats and "store hits" in stats
    browser.save_screenshot(str(shots / "ui_ask.png"))

    _tab(browser, wait, "Tokens", "#explain")
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#cb-token-map .cb-recomputed"))
    tokens = browser.find_elements(By.CSS_SELECTOR, "#cb-token-map .cb-token")
    recomputed = browser.find_elements(By.CSS_SELECTOR, "#cb-token-map .cb-recomputed")
    assert len(tokens) > 50 and 0 < len(recomputed) < len(tokens)
    browser.save_screenshot(str(shots / "ui_tokens.png"))

    tabs = (("Attention", "#attention", "#attention-plot img"), ("Speed", "#speed", "#speed-plot img"))
    for name, button, plot in tabs:
        _tab(browser, wait, name, button)
        wait.until(lambda b, plot=plot: b.find_elements(By.CSS_SELECTOR, plot))
        browser.save_screenshot(str(shots / f"ui_{name.lower()}.png"))
    assert all((shots / f"ui_{n}.png").stat().st_size > 10_000 for n in ("ask", "tokens", "attention", "speed"))
