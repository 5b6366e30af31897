"""The dashboard in a real browser: headless Chromium from Debian's packages (``chromium``,
``chromium-driver``; ``.ci/run`` installs them) loads every page of a store made by a real
training run, the metric charts and the timeline draw (DOM, canvas pixels, a screenshot),
the page refreshes itself when a checkpoint is committed, and the console stays clean.

``STEPVAULT_UI_SCREENSHOT=docs/ui-run.png pytest tests/test_ui_browser.py -m slow`` also
writes the run page's screenshot used in the README.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(
        f"headless browser test needs {CHROMIUM} and {CHROMEDRIVER}: "
        "apt-get install -y chromium chromium-driver",
        allow_module_level=True,
    )
pytest.importorskip("selenium")
pytest.importorskip("uvicorn")
os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download anything

import torch  # noqa: E402
import uvicorn  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from ui_util import RUN, make_trained_store  # noqa: E402

import stepvault  # noqa: E402
from stepvault.store import Store  # noqa: E402
from stepvault.ui import create_app  # noqa: E402

pytestmark = pytest.mark.slow

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1400",
]

# How many canvas pixels are not background: a drawn chart has thousands.
INK = """
const c = arguments[0], g = c.getContext('2d'), d = g.getImageData(0, 0, c.width, c.height).data;
let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n;
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = make_trained_store(tmp_path_factory.mktemp("browser") / "store")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(str(root), refresh_seconds=0.5)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(100):
        if srv.started:
            break
        time.sleep(0.05)
    yield root, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _wait(driver, css: str, count: int = 1, timeout: float = 15):
    WebDriverWait(driver, timeout).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, css)) >= count
    )
    return driver.find_elements(By.CSS_SELECTOR, css)


def test_every_page_renders_without_console_errors(server, browser):
    root, base = server
    steps = Store.open(root).list_steps(RUN)
    pages = {
        "/": "#runs",
        f"/runs/{RUN}": "#timeline-chart canvas",
        f"/runs/{RUN}/checkpoints/{steps[-1]}": "#tensors",
        "/registry": ".versions",
        f"/events?run={RUN}": "#events",
    }
    for path, css in pages.items():
        browser.get(base + path)
        _wait(browser, css)
        assert browser.find_element(By.ID, "live").text.startswith("live"), path
        assert _console_errors(browser) == [], path


def test_run_page_draws_the_timeline_metric_curves_and_retention(server, browser):
    root, base = server
    browser.get(f"{base}/runs/{RUN}")
    metrics = {k for c in stepvault.open(root).checkpoints(RUN) for k in c.metrics}
    charts = _wait(browser, ".metric-chart canvas", count=len(metrics))
    timeline = _wait(browser, "#timeline-chart canvas")[0]
    saves = _wait(browser, "#save-chart canvas")[0]
    for canvas in [timeline, saves, *charts]:
        assert browser.execute_script(INK, canvas) > 500  # lines and markers were drawn
    titles = {
        e.get_attribute("data-metric")
        for e in browser.find_elements(By.CSS_SELECTOR, ".metric-chart")
    }
    assert titles == set(metrics)
    rows = _wait(browser, "#retention-table tr", count=2)
    assert any("delete next" in r.text for r in rows) or any("keep" in r.text for r in rows)
    png = browser.get_screenshot_as_png()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 30_000
    out = os.environ.get("STEPVAULT_UI_SCREENSHOT")
    if out:
        Path(out).write_bytes(png)
    assert _console_errors(browser) == []


def test_run_page_refreshes_itself_when_a_checkpoint_is_committed(server, browser, tmp_path):
    root, base = server
    browser.get(f"{base}/runs/{RUN}")
    _wait(browser, "#timeline-chart canvas")
    time.sleep(1.2)  # the page has read its first change token
    new_step = Store.open(root).list_steps(RUN)[-1] + 1000
    stepvault.save(root, {"w": torch.ones(8)}, run=RUN, step=new_step, metrics={"loss": 0.01})
    WebDriverWait(browser, 15).until(
        lambda d: (
            f"/checkpoints/{new_step}"
            in d.find_element(By.ID, "checkpoints").get_attribute("innerHTML")
        )
    )
    _wait(browser, "#timeline-chart canvas")  # redrawn after the swap
    assert _console_errors(browser) == []
    Store.open(root).delete_manifest(RUN, new_step)  # leave the shared store as it was
