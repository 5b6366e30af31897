"""The dashboard at scale and during training (issue 29), through Starlette's test client
and real `stepvault` processes: a cold tier that never answers costs no page its latency,
a live run page gets only what changed, the retention preview is `stepvault gc --dry-run`'s
own plan on a tiered run, "best" follows what the run declared, tracker references show on
the checkpoint page, every checkpoint and event is a page away, and the access bugs
(a 127.0.0.x host, two token dashboards on one host) are gone."""

from __future__ import annotations

import http.cookiejar
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
import torch
from helpers import free_port
from starlette.testclient import TestClient
from ui_util import RUN, make_trained_store

import stepvault
from stepvault import CheckpointManager, Every, KeepBest, KeepLast
from stepvault.catalog.events import log_event
from stepvault.store import Store
from stepvault.tiers import CopyEvery, HotLast
from stepvault.tiers.config import TierSpec, add_tier
from stepvault.ui import create_app

BASE = "http://127.0.0.1"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return make_trained_store(tmp_path_factory.mktemp("ui-live") / "store")


class Blackhole:
    """A TCP server on loopback that accepts connections and never answers: an S3
    endpoint that has died behind a load balancer (the worst case: no quick refusal)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _get_within(client: TestClient, url: str, seconds: float):
    """GET ``url`` on a thread; None when it has not answered within ``seconds`` (the old
    dashboard waited out the dead tier's connection retries on every request: minutes)."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(client.get(url)), daemon=True)
    worker.start()
    worker.join(seconds)
    return out[0] if out else None


def test_a_dead_cold_tier_costs_no_page_its_latency(tmp_path, monkeypatch):
    pytest.importorskip("s3fs", reason="the dead tier is an s3:// URL: pip install s3fs")
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    root = tmp_path / "store"
    for step in (1, 2, 3):
        stepvault.save(root, {"w": torch.ones(4) * step}, run="r", step=step)
    dead = Blackhole()
    try:
        add_tier(
            Store.open(root),
            TierSpec(
                "s3arch", "s3://b/c", options={"endpoint_url": f"http://127.0.0.1:{dead.port}"}
            ),
        )
        client = TestClient(create_app(str(root)), base_url=BASE)
        for url in ("/", "/runs/r", "/runs/r/checkpoints/3", "/api/changes", "/events"):
            r = _get_within(client, url, 30)
            assert r is not None, f"{url} waited for the dead tier"
            assert r.status_code == 200, (url, r.text[:200])
        # the probe gives up on it (bounded) and the store page says since when
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            tier = client.get("/api/store").json()["tiers"]["s3arch"]
            if tier["state"] == "unreachable":
                break
            time.sleep(0.5)
        assert tier["state"] == "unreachable" and tier["since"] > 0, tier
        assert "unreachable since" in client.get("/").text
        run = client.get("/api/runs/r").json()
        assert [c["step"] for c in run["checkpoints"]] == [1, 2, 3]
    finally:
        dead.close()


def test_a_live_run_page_gets_only_what_changed(trained, tmp_path):
    root = tmp_path / "store"
    import shutil

    shutil.copytree(trained, root)
    client = TestClient(create_app(str(root)), base_url=BASE)
    full = client.get(f"/api/runs/{RUN}", headers={"Accept-Encoding": "gzip"})
    assert full.headers.get("content-encoding") == "gzip"  # a long run's JSON, compressed
    doc = full.json()
    cursor = doc["cursor"]
    same = client.get(f"/api/runs/{RUN}", params={"since": cursor}).json()
    assert same == {"delta": True, "unchanged": True, "cursor": cursor}
    step = doc["checkpoints"][-1]["step"] + 4
    with CheckpointManager(root, run=RUN, save=Every(steps=1), async_save=False) as mgr:
        mgr.save(step, {"w": torch.ones(8)}, metrics={"loss": 0.125, "val_loss": 0.5})
    delta_r = client.get(f"/api/runs/{RUN}", params={"since": cursor})
    delta = delta_r.json()
    assert [c["step"] for c in delta["checkpoints"]] == [step]
    assert delta["metrics"]["loss"] == [[step, 0.125]]
    assert [s["step"] for s in delta["saves"]] == [step]
    assert delta["cursor"] != cursor and delta["count"] == len(doc["checkpoints"]) + 1
    # what was sent is what changed: a small fraction of the whole run's data
    whole = client.get(f"/api/runs/{RUN}").content
    assert len(delta_r.content) * 4 < len(whole), (len(delta_r.content), len(whole))
    r = client.get(f"/api/runs/{RUN}", params={"since": "nonsense"})
    assert r.status_code == 400 and "cursor" in r.json()["error"]


def test_static_files_are_cacheable_pages_are_not(trained):
    client = TestClient(create_app(str(trained)), base_url=BASE)
    page = client.get("/")
    assert page.headers["cache-control"] == "no-store"
    src = next(part.split('"')[0] for part in page.text.split('src="')[1:] if "app.js" in part)
    assert "?v=" in src  # the URL names the content, so it can be cached for good
    static = client.get(src)
    assert static.status_code == 200 and "immutable" in static.headers["cache-control"]
    assert client.get("/static/nope.js").headers["cache-control"] == "no-store"
    missing = client.get("/no/such/page")
    assert missing.status_code == 404 and 'href="/static/style.css' in missing.text


def _tiered_run(root: Path) -> None:
    """A run kept by KeepLast(3) | KeepBest(1, val_mape) whose older checkpoints were
    moved to a local archive tier (archive-only: gc of the hot store does not see them)."""
    archive = root.parent / "archive"
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(
        root,
        run="t",
        save=Every(steps=1),
        keep=KeepLast(3) | KeepBest(1, metric="val_mape", mode="min"),
        tiers={"archive": str(archive)},
        tier_policy=HotLast(4) | CopyEvery("archive", steps=1),
        async_save=False,
    )
    for step in range(1, 13):
        with torch.no_grad():
            model.weight.add_(0.01)
        # the best val_mape is an early step; lr has no declared direction
        mgr.save(step, {"m": model}, metrics={"val_mape": abs(step - 3) + 0.5, "lr": 1e-3})
    mgr.close()


def _gc_dry_run(root: Path, run: str, *args: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepvault.cli.main",
            "--root",
            str(root),
            "gc",
            run,
            *args,
            "--dry-run",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_retention_preview_is_gc_dry_run_on_a_tiered_run(tmp_path):
    root = tmp_path / "store"
    _tiered_run(root)
    hot_steps = Store.open(root).list_steps("t")
    client = TestClient(create_app(str(root)), base_url=BASE)
    everywhere = [c["step"] for c in client.get("/api/runs/t").json()["checkpoints"]]
    assert set(everywhere) > set(hot_steps)  # some steps are in the archive only
    # rules typed in: the same plan as gc --dry-run with the same rules
    typed = client.get("/api/runs/t/retention", params={"keep_last": "1"}).json()
    gc = _gc_dry_run(root, "t", "--keep-last", "1")
    assert typed["delete"] == gc["deleted_checkpoints"]
    assert {e["step"]: e["keep"] for e in typed["entries"]} == {
        e["step"]: e["keep"] for e in gc["plan"]
    }
    assert set(typed["delete"]) <= set(hot_steps)  # never an archive-only step
    # no rules typed: the run's own keep policy, and the command that plans it
    own = client.get("/api/runs/t/retention").json()
    assert own["source"] == "configured" and "KeepBest(1, 'val_mape'" in own["policy"]
    assert own["command"].endswith(
        "--keep-last 3 --keep-best 1 --metric val_mape --mode min --dry-run"
    )
    args = own["command"].split(" gc t ")[1].split()[:-1]
    assert own["delete"] == _gc_dry_run(root, "t", *args)["deleted_checkpoints"]
    # a misspelt metric is named, with the nearest one the run recorded
    r = client.get(
        "/api/runs/t/retention", params={"keep_best": "1", "metric": "val_mpae", "mode": "min"}
    )
    assert r.status_code == 400 and "did you mean 'val_mape'" in r.json()["error"]
    # best is what the run declared: val_mape (min), never lr
    doc = client.get("/api/runs/t").json()
    assert doc["best_modes"] == {"val_mape": "min"}
    best = [c["step"] for c in doc["checkpoints"] if c["best"]]
    assert best == [3]


def test_a_keep_everything_run_previews_no_deletions_and_long_lists_fold(tmp_path):
    root = tmp_path / "store"
    with CheckpointManager(root, run="k", save=Every(steps=1), async_save=False) as mgr:
        for step in range(1, 81):
            mgr.save(step, {"w": torch.ones(2) * step}, metrics={"loss": 1 / step})
    client = TestClient(create_app(str(root)), base_url=BASE)
    own = client.get("/api/runs/k/retention").json()
    assert own["delete"] == [] and "no keep policy" in own["note"]
    typed = client.get("/api/runs/k/retention", params={"keep_last": "2"}).json()
    assert len(typed["delete"]) == 78
    assert typed["summary"] == "1\u201378 (78 checkpoints)"
    folded = [r for r in typed["rows"] if not r["keep"]]
    assert len(folded) == 1 and folded[0]["count"] == 78
    assert typed["entries"] == []  # the plan is summarised, not spelt out 80 times


def test_run_table_pages_and_finds_a_step(tmp_path):
    root = tmp_path / "store"
    with CheckpointManager(root, run="p", save=Every(steps=1), async_save=False) as mgr:
        for step in range(5, 2030, 5):  # 405 checkpoints: three pages of 200
            mgr.save(step, {"w": torch.ones(2)}, metrics={"loss": 1.0})
    client = TestClient(create_app(str(root)), base_url=BASE)
    first = client.get("/runs/p").text
    assert "page 1 of 3" in first and 'href="/runs/p/checkpoints/5"' not in first
    last = client.get("/runs/p?page=2").text  # the oldest page: the first checkpoint
    assert 'href="/runs/p/checkpoints/5"' in last and 'id="older-page"' not in last
    found = client.get("/runs/p?step=1003").text
    assert "nearest is" in found and 'class=" found" data-step="1005"' in found


def test_events_are_paged_back_to_the_first(tmp_path):
    root = tmp_path / "store"
    store = Store.open(root, create=True)
    store.ensure_run("e", {"run": "e", "created": time.time()})
    for i in range(1100):
        log_event(store, "e", "note", step=i, value=i / 1000 + 1 / 3)
    client = TestClient(create_app(str(root)), base_url=BASE)
    newest = client.get("/api/events", params={"run": "e"}).json()
    assert newest["total"] == 1100 and len(newest["events"]) == 1000
    assert newest["events"][0]["step"] == 1099
    assert ["value", "1.432"] in newest["events"][0]["details"]  # 4 digits, not a float repr
    oldest = client.get("/api/events", params={"run": "e", "offset": "1000"}).json()
    assert [e["step"] for e in oldest["events"]] == list(range(99, -1, -1))
    page = client.get("/events?run=e").text
    assert 'id="oldest" href="/events?offset=100&amp;run=e"' in page


def test_checkpoint_page_shows_tracker_refs_annotations_and_tables(trained, tmp_path):
    import shutil

    root = tmp_path / "store"
    shutil.copytree(trained, root)
    store = Store.open(root)
    step = store.list_steps(RUN)[-2]  # annotated with val_accuracy by the eval job
    log_event(
        store,
        RUN,
        "tracker_ref",
        step=step,
        tracker="mlflow",
        ref="http://127.0.0.1:5000/#/experiments/1/runs/abc",
        name="mlp-abc",
    )
    log_event(store, RUN, "tracker_ref", step=step, tracker="ray", ref="file:///r/x", name="t1")
    client = TestClient(create_app(str(root)), base_url=BASE)
    doc = client.get(f"/api/runs/{RUN}/checkpoints/{step}").json()
    assert doc["metrics"]["val_accuracy"] == 0.71 and "val_accuracy" not in doc["saved_metrics"]
    refs = {r["tracker"]: r for r in doc["referenced_by"]}
    assert refs["mlflow"]["name"] == "mlp-abc" and refs["ray"]["link"] is None
    html = client.get(f"/runs/{RUN}/checkpoints/{step}").text
    assert 'href="http://127.0.0.1:5000/#/experiments/1/runs/abc"' in html
    assert "Referenced by" in html and "file:///r/x" in html
    assert '<table id="lineage"' in html and "code.git_commit" in html
    assert "<time data-ts=" in html  # times with their zone, rewritten in the browser's


def test_any_loopback_host_is_answered(trained):
    client = TestClient(create_app(str(trained)), base_url="http://127.0.0.2:8765")
    assert client.get("/").status_code == 200
    assert client.get("/", headers={"Host": "[::1]:8765"}).status_code == 200
    assert client.get("/", headers={"Host": "evil.example"}).status_code == 400


def _serve(root: Path, port: int, token: str) -> subprocess.Popen:
    env = {**os.environ, "STEPVAULT_UI_TOKEN": token}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stepvault.cli.main",
            "ui",
            "--root",
            str(root),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"stepvault ui on {port} did not start")


def test_two_token_dashboards_on_one_host_keep_their_own_cookies(trained):
    ports = free_port(), free_port()
    tokens = "first-token-0123456789", "second-token-0123456789"
    procs = [_serve(trained, p, t) for p, t in zip(ports, tokens)]
    try:
        jar = http.cookiejar.CookieJar()  # one browser: cookies are shared across ports
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        for port, token in zip(ports, tokens):
            with opener.open(f"http://127.0.0.1:{port}/?token={token}", timeout=60) as r:
                assert r.status == 200
        for port in ports:  # both still open with their cookie alone
            with opener.open(f"http://127.0.0.1:{port}/api/changes", timeout=60) as r:
                assert r.status == 200 and "token" in json.loads(r.read())
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def test_compare_two_checkpoints_is_stepvault_diff_in_the_page(trained):
    from stepvault.ops.tensor_diff import diff

    client = TestClient(create_app(str(trained)), base_url=BASE)
    steps = Store.open(trained).list_steps(RUN)
    a, b = steps[-2], steps[-1]
    doc = client.get(f"/api/runs/{RUN}/checkpoints/{b}/compare", params={"with": str(a)}).json()
    cli = diff(trained, f"{RUN}@{a}", f"{RUN}@{b}").to_json()
    assert doc["tensors"] == cli["tensors"] and doc["exact_bytes"] == cli["exact_bytes"]
    assert doc["counts"].get("changed", 0) >= 1
    html = client.get(f"/runs/{RUN}/checkpoints/{b}/compare", params={"with": f"{RUN}@{a}"}).text
    assert 'id="diff"' in html and f"diff {RUN}@{a} {RUN}@{b}" in html
    assert 'id="compare-form"' in client.get(f"/runs/{RUN}/checkpoints/{b}").text
    missing = client.get(f"/runs/{RUN}/checkpoints/{b}/compare", params={"with": "7"})
    assert missing.status_code == 404 and f"{RUN}@7" in missing.text
    bad = client.get(f"/api/runs/{RUN}/checkpoints/{b}/compare", params={"with": "../x@1"})
    assert bad.status_code == 400


def test_a_checkpoint_thinned_while_the_page_is_open_is_shown_thinned(tmp_path):
    root = tmp_path / "store"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(root, run="th", save=Every(steps=1), async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": model, "optimizer": opt}, metrics={"loss": 1 / step})
    client = TestClient(create_app(str(root)), base_url=BASE)
    kinds = {c["step"]: c["kind"] for c in client.get("/api/runs/th").json()["checkpoints"]}
    assert kinds == {1: "full", 2: "full", 3: "full"}
    proc = subprocess.run(
        [sys.executable, "-m", "stepvault.cli.main", "--root", str(root), "gc", "th",
         "--keep-last", "3", "--thin-after-steps", "1", "--grace", "0s"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # within the same server (its records cached): the rewritten manifests are read again
    kinds = {c["step"]: c["kind"] for c in client.get("/api/runs/th").json()["checkpoints"]}
    assert kinds[1] == "weights" and kinds[3] == "full", kinds


def test_a_port_in_use_is_an_error_and_port_0_announces_the_port_it_got(trained):
    """The banner came before the bind: a port in use announced a URL another dashboard
    answered (then uvicorn's error, exit 3); ``--port 0`` announced ``:0``."""
    cmd = [sys.executable, "-m", "stepvault.cli.main", "ui", "--root", str(trained)]
    first = subprocess.Popen(
        [*cmd, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert first.stdout is not None
        banner = first.stdout.readline()
        port = int(banner.split("http://127.0.0.1:")[1].split("/")[0])
        assert port > 0, banner
        deadline = time.monotonic() + 60
        while True:  # bound at the banner; answering once uvicorn has started
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60) as r:
                    assert r.status == 200
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the dashboard never answered"
                time.sleep(0.1)
        second = subprocess.run(
            [*cmd, "--port", str(port)], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2, second.stdout + second.stderr
        out = second.stdout + second.stderr
        assert f"cannot serve on 127.0.0.1:{port}" in out and "stepvault ui (" not in out
    finally:
        first.terminate()
        first.wait(30)
