"""The dashboard in a real headless Chromium (Debian's chromium and chromium-driver, through
selenium) against a real server: the page loads with no console errors, its plots update while
a load runs, and its load and unload buttons work when model control is on."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, start_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ECHO = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "dashboard.png"

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (scripts/install-system-packages.sh)",
)


@pytest.fixture(scope="module")
def dashboard_server(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("dashboard-repo")
    for name in ("echo", "slow"):
        shutil.copytree(test_repo / name, repo / name)
    server = start_server(
        repo,
        tmp_path_factory.mktemp("dashboard"),
        "--no-llm",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="lockgate-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("condition not met within the timeout")


def test_plots_update_while_a_load_runs(
    browser: object, dashboard_server: RunningServer, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(dashboard_server.url + "/")  # type: ignore[attr-defined]
    assert driver.current_url.endswith("/dashboard")  # type: ignore[attr-defined]

    def scrapes() -> int:
        return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-scrapes"))  # type: ignore[attr-defined]

    wait_for(lambda: scrapes() >= 2)
    card = driver.find_element(By.CSS_SELECTOR, '.card[data-model="echo"]')  # type: ignore[attr-defined]
    assert float(card.get_attribute("data-rate")) == 0.0
    rate_plot = card.find_element(By.CSS_SELECTOR, 'canvas[data-plot="rate"]')
    points_before = int(rate_plot.get_attribute("data-points"))

    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=dashboard_server.url) as client:
            while not stop.is_set():
                client.post("/v2/models/echo/infer", json=ECHO)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_for(lambda: float(card.get_attribute("data-rate")) > 1.0)
        start = scrapes()
        wait_for(lambda: scrapes() >= start + 2)
    finally:
        stop.set()
        worker.join()
    assert int(rate_plot.get_attribute("data-points")) >= points_before + 2
    latency = card.find_element(By.CSS_SELECTOR, 'canvas[data-plot="latency"]')
    assert "p50:" in latency.find_element(By.XPATH, "..").text
    driver.save_screenshot(str(tmp_path / "dashboard.png"))  # type: ignore[attr-defined]
    if os.environ.get("LOCKGATE_UPDATE_SCREENSHOT"):  # the README's picture
        SCREENSHOT.write_bytes((tmp_path / "dashboard.png").read_bytes())
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[attr-defined]
    assert not errors, errors


def test_unload_and_load_buttons(browser: object, dashboard_server: RunningServer) -> None:
    driver = browser
    driver.get(dashboard_server.url + "/dashboard")  # type: ignore[attr-defined]

    # the table is redrawn on every poll: ask the live DOM, not a held element
    def row_state(name: str) -> str:
        row = f"document.querySelector('tr[data-model=\"{name}\"]')"
        script = f"const r = {row}; return r ? r.dataset.state : '';"
        return str(driver.execute_script(script))  # type: ignore[attr-defined]

    def click(name: str, action: str) -> None:
        selector = f'tr[data-model="{name}"] button[data-action="{action}"]'
        driver.execute_script(f"document.querySelector('{selector}').click()")  # type: ignore[attr-defined]

    wait_for(lambda: row_state("slow") == "READY")
    click("slow", "unload")
    wait_for(lambda: row_state("slow") == "UNLOADED")
    assert httpx.get(dashboard_server.url + "/v2/models/slow/ready").status_code == 404
    click("slow", "load")
    wait_for(lambda: row_state("slow") == "READY")
    assert httpx.get(dashboard_server.url + "/v2/models/slow/ready").status_code == 200
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[attr-defined]
    assert not errors, errors


GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "lockgate-dashboard.json"


def test_the_grafana_dashboard_uses_only_metrics_the_server_exports(
    llm_server: RunningServer,
) -> None:
    """Against a server with a classic model and a language model, both having served."""
    import json
    import re

    import openai

    from lockgate.demo.smollm2 import SERVED_NAME

    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"\b(lockgate_[a-z_]+)", e)}
    client = openai.OpenAI(base_url=llm_server.url + "/v1", api_key="none", max_retries=0)
    client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=2)
    client.embeddings.create(model="minilm", input=["every series exists"])
    scrape = httpx.get(llm_server.url + "/metrics").text
    # a labelled counter has its HELP and TYPE lines before its first event
    exported = set(re.findall(r"^(?:# TYPE )?(lockgate_[a-z_]+)", scrape, re.M))
    missing = used - exported
    assert not missing, missing
