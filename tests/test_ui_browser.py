"""The dashboard in a real browser: headless Chromium from Debian's packages (``chromium``,
``chromium-driver``; ``.ci/run`` installs them) loads every page of a store made by a real
training run, the metric charts and the timeline draw (DOM, canvas pixels, a screenshot),
the page refreshes itself when a checkpoint is committed, and the console stays clean.

``STEPVAULT_UI_SCREENSHOT=docs/ui-run.png pytest tests/test_ui_browser.py -m slow`` also
writes the run page's screenshot used in the README.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
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

import shutil  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import uvicorn  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from ui_util import EVERY, RUN, STEPS, make_trained_store  # noqa: E402

import stepvault  # noqa: E402
from stepvault import CheckpointManager, Every  # noqa: E402
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


@contextlib.contextmanager
def serving(root: Path):
    """The dashboard over ``root`` on a free loopback port (uvicorn on a thread)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(str(root), refresh_seconds=0.5)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = make_trained_store(tmp_path_factory.mktemp("browser") / "store")
    with serving(root) as base:
        yield root, base


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


def _leave(driver) -> None:
    """Leave the page before its server stops (its polls would fail in the next test)."""
    driver.get("about:blank")
    driver.get_log("browser")


def _chart(driver, expr: str):
    return driver.execute_script(f"return {expr};")


def test_zoom_is_kept_across_a_live_update(server, browser):
    root, base = server
    browser.get(f"{base}/runs/{RUN}")
    _wait(browser, ".metric-chart canvas")
    time.sleep(1.2)  # the page has read its first change token
    steps = _chart(browser, "stepvaultCharts.metrics.loss.data[0]")
    lo, hi = steps[1], steps[-2]
    browser.execute_script(
        "stepvaultCharts.metrics.loss.setScale('x', {min: arguments[0], max: arguments[1]});",
        lo,
        hi,
    )
    new_step = Store.open(root).list_steps(RUN)[-1] + 2000
    with CheckpointManager(root, run=RUN, save=Every(steps=1), async_save=False) as mgr:
        mgr.save(new_step, {"w": torch.ones(8)}, metrics={"loss": 0.02})
    WebDriverWait(browser, 15).until(
        lambda d: new_step in _chart(d, "stepvaultCharts.metrics.loss.data[0]")
    )
    # the new point was appended to the same chart, and its zoom stayed where it was
    assert _chart(browser, "stepvaultCharts.metrics.loss.scales.x.min") == lo
    assert _chart(browser, "stepvaultCharts.metrics.loss.scales.x.max") == hi
    assert _console_errors(browser) == []
    Store.open(root).delete_manifest(RUN, new_step)  # leave the shared store as it was


def test_curves_keep_the_steps_retention_deleted(server, browser):
    root, base = server
    browser.get(f"{base}/runs/{RUN}")
    _wait(browser, ".metric-chart canvas")
    kept = set(Store.open(root).list_steps(RUN))
    xs = _chart(browser, "stepvaultCharts.metrics.val_loss.data[0]")
    deleted = _chart(browser, "stepvaultCharts.metrics.val_loss.data[2]")  # the 'deleted' marks
    saved = list(range(EVERY, STEPS + 1, EVERY))
    assert [x for x in xs if x in saved] == saved  # every save, deleted ones included
    assert {x for x, d in zip(xs, deleted) if d is not None} == set(saved) - kept
    assert _console_errors(browser) == []


def test_a_dead_cold_tier_does_not_hold_the_pages(browser, tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    from test_ui_live import Blackhole

    from stepvault.tiers.config import TierSpec, add_tier

    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "store"
    for step in (1, 2, 3):
        stepvault.save(root, {"w": torch.ones(4) * step}, run="r", step=step, metrics={"l": step})
    hole = Blackhole()
    try:
        url = f"http://127.0.0.1:{hole.port}"
        add_tier(Store.open(root), TierSpec("s3arch", "s3://b/c", options={"endpoint_url": url}))
        with serving(root) as base:
            for path, css in (("/", "#tiers"), ("/runs/r", "#timeline-chart canvas")):
                browser.get(base + path)
                _wait(browser, css, timeout=30)
            browser.get(base + "/")
            WebDriverWait(browser, 60).until(  # the live page follows the probe's verdict
                lambda d: "unreachable since" in d.find_element(By.ID, "tiers").text
            )
            assert _console_errors(browser) == []
            _leave(browser)
    finally:
        hole.close()


def test_paging_to_the_first_checkpoint_of_a_10k_run(browser, tmp_path):
    from ui_util import make_long_run

    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else tmp_path)) / "store"
    try:
        make_long_run(root, "long", 10_000)
        with serving(root) as base:
            browser.get(f"{base}/runs/long")
            _wait(browser, "#checkpoints tbody tr", count=200, timeout=60)
            browser.find_element(By.ID, "oldest-page").click()
            link = WebDriverWait(browser, 30).until(
                lambda d: d.find_element(By.CSS_SELECTOR, 'a[href="/runs/long/checkpoints/1"]')
            )
            link.click()
            WebDriverWait(browser, 30).until(
                lambda d: "long@1" in d.find_element(By.TAG_NAME, "h1").text
            )
            browser.get(f"{base}/runs/long?step=4321")
            row = _wait(browser, "#checkpoints tr.found")[0]
            assert row.get_attribute("data-step") == "4321"
            assert _console_errors(browser) == []
            _leave(browser)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


def test_the_retention_preview_is_gc_dry_run_on_a_tiered_run(browser, tmp_path):
    from test_ui_live import _tiered_run

    root = tmp_path / "store"
    _tiered_run(root)
    proc = subprocess.run(
        [sys.executable, "-m", "stepvault.cli.main", "--root", str(root), "gc", "t",
         "--keep-last", "2", "--dry-run", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    gc = json.loads(proc.stdout)["deleted_checkpoints"]
    assert gc  # the rule deletes something from the hot store
    with serving(root) as base:
        browser.get(f"{base}/runs/t?keep_last=2")
        summary = _wait(browser, "#retention-summary", timeout=30)[0].text
        assert summary.endswith("would delete: " + ", ".join(map(str, gc))), summary
        rows = browser.find_elements(
            By.CSS_SELECTOR, "#retention-table tr.keep-false td:first-child"
        )
        shown = [int(s) for r in rows for s in r.text.split(" ")[0].split("\u2013")]
        assert set(shown) <= set(gc) and min(shown) == min(gc) and max(shown) == max(gc)
        assert _console_errors(browser) == []
        _leave(browser)
