"""The dashboard (``stepvault ui``) through Starlette's test client: every page and JSON
endpoint over a store made by a real training run, hostile URLs, the token, read-only
browsing (the store's files are compared before and after), actions, and a store that
another process writes while the pages are read."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from helpers import free_port
from starlette.testclient import TestClient
from ui_util import BROKEN, EVERY, RUN, STEPS, make_trained_store, tree_state

from stepvault.catalog.events import read_events
from stepvault.store import Store
from stepvault.ui import UnsafeBindError, check_bind, create_app

BASE = "http://127.0.0.1"
UI_CMD = [sys.executable, "-m", "stepvault.cli.main", "ui"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return make_trained_store(tmp_path_factory.mktemp("ui") / "store")


@pytest.fixture
def client(trained) -> TestClient:
    return TestClient(create_app(str(trained)), base_url=BASE)


def _every_page(trained: Path) -> list[str]:
    steps = Store.open(trained).list_steps(RUN)
    return [
        "/",
        f"/runs/{RUN}",
        f"/runs/{BROKEN}",
        *[f"/runs/{RUN}/checkpoints/{s}" for s in steps],
        f"/runs/{BROKEN}/checkpoints/20",
        "/registry",
        "/events",
        f"/events?run={RUN}&kind=save",
        "/api/store",
        f"/api/runs/{RUN}",
        f"/api/runs/{RUN}/retention",
        f"/api/runs/{RUN}/retention?keep_last=2&keep_best=1&metric=val_loss&mode=min",
        f"/api/runs/{RUN}/checkpoints/{steps[-1]}",
        "/api/registry",
        "/api/events",
        "/api/changes",
        "/static/app.js",
        "/static/vendor/uPlot.iife.min.js",
    ]


#: a damaged checkpoint's page is answered, with the way out, as 422 (not a page that worked)
DAMAGED_PAGE = f"/runs/{BROKEN}/checkpoints/20"


def _expected(url: str) -> int:
    return 422 if url == DAMAGED_PAGE else 200


def test_every_page_and_endpoint_answers(client, trained):
    for url in _every_page(trained):
        r = client.get(url)
        assert r.status_code == _expected(url), (url, r.text[:300])
        assert r.headers["x-frame-options"] == "DENY"
        assert "default-src 'self'" in r.headers["content-security-policy"]


def test_store_page_shows_runs_savings_damage_and_models(client):
    doc = client.get("/api/store").json()
    runs = {r["run"]: r for r in doc["runs"]}
    assert set(runs) == {RUN, BROKEN}
    assert runs[BROKEN]["damaged"][0]["step"] == 20
    assert "checksum" in runs[BROKEN]["damaged"][0]["error"]
    assert runs[RUN]["newest_step"] == STEPS
    assert doc["usage"]["logical_bytes"] > doc["usage"]["raw_bytes"] > 0  # dedup saved bytes
    assert [m["model"] for m in doc["models"]] == ["mlp"]
    html = client.get("/").text
    assert f'href="/runs/{RUN}"' in html and "DAMAGED" not in html and ">20<" in html
    # the top card counts every checkpoint the rows count, the damaged one named
    total = sum(r["checkpoints"] for r in doc["runs"])
    assert doc["usage"]["checkpoints"] + doc["usage"]["damaged"] == total
    assert doc["usage"]["damaged"] == 1
    # The page does not scan the objects: it says so (null), not a measured 0 that
    # contradicted `du`'s count of unreferenced objects.
    assert doc["usage"]["unreferenced_objects"] is None
    assert doc["usage"]["unreferenced_bytes"] is None
    full = client.get("/?usage=1").text
    assert f"<b>{total}</b><span>checkpoints (1 damaged)" in full
    assert 'id="usage" data-pending="1"' in html  # sent at once, the sizes fetched after


def test_run_page_marks_pinned_registered_best_and_saves(client, trained):
    doc = client.get(f"/api/runs/{RUN}").json()
    cps = {c["step"]: c for c in doc["checkpoints"]}
    store = Store.open(trained)
    assert [s for s, c in cps.items() if c["pinned"]] == store.pinned_steps(RUN)
    registered = {s for s, c in cps.items() if c["registered"]}
    assert len(registered) == 2 and any(
        "stable" in r for c in cps.values() for r in c["registered"]
    )
    best_val = min((c for c in cps.values()), key=lambda c: c["metrics"]["val_loss"])
    assert "val_loss" in best_val["best"]
    assert "val_accuracy" in doc["metrics"]  # the annotation's metric is a curve too
    # the curve is the run's whole history: every save, deleted checkpoints included
    saved = list(range(EVERY, STEPS + 1, EVERY))
    assert [p[0] for p in doc["metrics"]["loss"]] == saved
    assert doc["deleted_steps"] == sorted(set(saved) - set(cps))
    # "best" is what the run declared (its KeepBest on val_loss), never guessed by name
    assert doc["best_modes"] == {"val_loss": "min"}
    assert not any(c["best"] for c in cps.values() if c["best"] != ["val_loss"])
    # every save of the training run is in the per-save statistics, deleted ones included
    assert [s["step"] for s in doc["saves"]] == list(range(EVERY, STEPS + 1, EVERY))
    assert all(s["stall_seconds"] > 0 and s["throughput_bytes_per_s"] > 0 for s in doc["saves"])
    assert {d["step"] for d in doc["deletions"]} == set(range(EVERY, STEPS + 1, EVERY)) - set(cps)
    html = client.get(f"/runs/{RUN}").text
    assert 'id="timeline-chart"' in html and 'id="metric-charts"' in html
    assert "paper figure" not in html  # notes are on the events page, not here
    assert "best val_loss" in html and "pinned" in html


def test_retention_preview_says_which_rule_keeps_what(client, trained):
    plan = client.get(f"/api/runs/{RUN}/retention?keep_last=1").json()
    by_step = {e["step"]: e for e in plan["entries"]}
    steps = Store.open(trained).list_steps(RUN)
    assert by_step[steps[-1]]["keep"] and "last 1" in by_step[steps[-1]]["reasons"]
    store = Store.open(trained)
    held = store.held_steps(RUN)
    for step in store.protected_steps(RUN):
        reasons = by_step[step]["reasons"]
        assert by_step[step]["keep"], step
        if step in store.pinned_steps(RUN):
            assert "pinned" in reasons, reasons
        if step in held:  # a registry hold says which model version holds it, not "pinned"
            assert any(r.startswith("held by the registry (model ") for r in reasons), reasons
    assert plan["delete"] and all(not by_step[s]["keep"] for s in plan["delete"])
    r = client.get(f"/api/runs/{RUN}/retention?keep_last=-3")
    assert r.status_code == 400 and "positive integer" in r.json()["error"]


def test_checkpoint_page_tensors_changes_lineage_and_commands(client, trained):
    steps = Store.open(trained).list_steps(RUN)
    doc = client.get(f"/api/runs/{RUN}/checkpoints/{steps[-1]}").json()
    names = {t["name"] for t in doc["tensors"]}
    assert "model/0.weight" in names and any(n.startswith("optimizer/") for n in names)
    assert doc["previous_step"] == steps[-2]
    assert doc["changed_tensors"] >= 1
    assert doc["verify"]["ok"] and doc["signature"] is None
    assert doc["lineage"]["lineage"]["code"]["git_commit"]
    assert f"export {RUN}@{steps[-1]}" in doc["commands"]["export"]
    damaged = client.get(DAMAGED_PAGE)
    assert damaged.status_code == 422 and "DAMAGED" in damaged.text
    assert f"repair {BROKEN}" in damaged.text and f"verify {BROKEN}@20 --deep" in damaged.text


def test_registry_and_events_pages(client):
    reg = client.get("/api/registry").json()["models"][0]
    assert reg["aliases"] == {"candidate": 1, "stable": 1}
    actions = [(h["alias"], h["action"]) for h in reg["history"]]
    assert actions[-1] == ("stable", "rollback") and ("candidate", "promote") in actions
    assert "regression on eval set" in client.get("/registry").text
    ev = client.get(f"/api/events?run={RUN}&kind=delete").json()
    assert ev["total"] > 0 and {e["event"] for e in ev["events"]} == {"delete"}
    assert {"save", "pin", "annotate", "register"} <= set(ev["kinds"])
    times = [e["time"] for e in client.get("/api/events").json()["events"]]
    assert times == sorted(times, reverse=True)


HOSTILE = [
    "/runs/..",
    "/runs/..%2F..%2Fetc",
    "/runs/%2e%2e/checkpoints/1",
    "/runs/a%2Fb",
    "/runs/%00",
    "/runs/.hidden",
    f"/runs/{'x' * 300}",
    f"/runs/{RUN}/checkpoints/99999999999999999999999999",
    f"/runs/{RUN}/checkpoints/-1",
    f"/runs/{RUN}/checkpoints/1e3",
    f"/runs/{RUN}/checkpoints/%D9%A3",  # an Arabic-Indic digit: isdigit() but not ASCII
    f"/runs/{RUN}/checkpoints/7",
    "/runs/nope",
    "/api/runs/..%2Fstepvault.json",
    f"/api/runs/{RUN}/checkpoints/..",
    "/static/../data.py",
    "/static/%2e%2e/app.py",
    "/events?run=../../etc",
    "/events?kind=%3Cscript%3E",
]


def _raw_get(app, url: str) -> tuple[int, str]:
    """GET ``url`` exactly as written (an HTTP client would normalise ``..`` away first, a
    hostile one does not): the path is percent-decoded as uvicorn does, nothing else."""
    path, _, query = url.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": unquote(path),
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]).decode()


@pytest.mark.parametrize("url", HOSTILE)
def test_hostile_urls_get_400_or_404(trained, url):
    status, text = _raw_get(create_app(str(trained)), url)
    assert status in (400, 404), (url, status, text[:200])
    assert "<script>" not in text
    assert "def " not in text and '"format"' not in text  # no file content leaked


def test_browsing_every_page_writes_nothing(trained):
    # The training run left a summaries log that a writable listing would compact and remove.
    before = tree_state(trained)
    client = TestClient(create_app(str(trained)), base_url=BASE)
    for url in _every_page(trained):
        assert client.get(url).status_code == _expected(url)
    assert client.post("/api/actions/pin", json={"run": RUN, "step": STEPS}).status_code == 403
    assert tree_state(trained) == before


def test_token_is_required_for_a_non_loopback_address(trained):
    with pytest.raises(UnsafeBindError, match="needs a token"):
        check_bind("0.0.0.0", None)
    with pytest.raises(UnsafeBindError, match="16 characters"):
        check_bind("192.168.1.5", "short")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    proc = subprocess.run(
        [*UI_CMD, "--root", str(trained), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "STEPVAULT_UI_TOKEN"},
    )
    assert proc.returncode == 2 and "needs a token" in proc.stderr


def test_requests_without_the_token_get_401(trained):
    token = "s3cret-token-0123456789"
    client = TestClient(
        create_app(str(trained), token=token, loopback_only=False), base_url="http://10.0.0.7"
    )
    assert client.get("/").status_code == 401
    assert client.get("/api/store").status_code == 401
    assert client.get("/static/app.js").status_code == 401
    assert (
        client.get("/", headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code
        == 401
    )
    assert client.get("/", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    r = client.get(f"/runs/{RUN}?token={token}&keep_last=2", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/runs/{RUN}?keep_last=2"
    assert "HttpOnly" in r.headers["set-cookie"]
    assert client.get(f"/runs/{RUN}").status_code == 200  # the cookie now carries it
    fresh = TestClient(client.app, base_url="http://10.0.0.7")  # no cookie yet
    r = fresh.get(f"/x%0D%0ASet-Cookie:%20a=b?token={token}", follow_redirects=False)
    assert r.status_code == 303 and "\r" not in r.headers["location"]
    assert r.headers["location"].startswith("/x%0D%0A")


def test_loopback_server_refuses_foreign_host_headers(client):
    assert client.get("/", headers={"Host": "evil.example"}).status_code == 400
    assert client.get("/", headers={"Host": "localhost:8765"}).status_code == 200


def test_actions_need_allow_actions_and_the_header_and_are_logged(trained, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(trained, root)
    client = TestClient(create_app(str(root), allow_actions=True), base_url=BASE)
    store = Store.open(root)
    steps = store.list_steps(RUN)
    target = steps[0]
    assert client.post("/api/actions/pin", json={"run": RUN, "step": target}).status_code == 400
    hdr = {"X-Stepvault-Action": "confirm"}
    r = client.post(
        "/api/actions/pin", json={"run": RUN, "step": target, "note": "ui"}, headers=hdr
    )
    assert r.status_code == 200, r.text
    assert target in store.pinned_steps(RUN)
    r = client.post(
        "/api/actions/annotate",
        json={"run": RUN, "step": target, "metrics": {"bleu": 30.5}},
        headers=hdr,
    )
    assert r.status_code == 200, r.text
    assert client.get(f"/api/runs/{RUN}").json()["checkpoints"][0]["metrics"]["bleu"] == 30.5
    r = client.post(
        "/api/actions/promote",
        json={"model": "mlp", "alias": "stable", "target": f"{RUN}@{steps[-1]}"},
        headers=hdr,
    )
    assert r.status_code == 200, r.text
    r = client.post("/api/actions/rollback", json={"model": "mlp", "alias": "stable"}, headers=hdr)
    assert r.status_code == 200 and r.json()["rolled_back"]["version"] == 1
    before = store.list_steps(RUN)
    r = client.post("/api/actions/gc-preview", json={"run": RUN, "keep_last": "1"}, headers=hdr)
    assert r.status_code == 200 and r.json()["dry_run"] and r.json()["deleted_checkpoints"]
    assert store.list_steps(RUN) == before  # a preview deletes nothing
    r = client.post("/api/actions/unpin", json={"run": RUN, "step": target}, headers=hdr)
    assert r.status_code == 200 and target not in store.pinned_steps(RUN)
    bad = client.post("/api/actions/pin", json={"run": "../x", "step": 1}, headers=hdr)
    assert bad.status_code == 400
    logged = [(e["event"], e.get("by")) for e in read_events(store, RUN)]
    assert ("pin", "ui") in logged and ("unpin", "ui") in logged and ("annotate", "ui") in logged
    # As the CLI: nothing to unpin, or no such run, is an error and logs nothing (it
    # answered ok and wrote an unpin event, for a run that does not exist too).
    again = client.post("/api/actions/unpin", json={"run": RUN, "step": target}, headers=hdr)
    assert again.status_code == 400 and "is not pinned" in again.json()["error"]
    ghost = client.post("/api/actions/unpin", json={"run": "ghost", "step": 5}, headers=hdr)
    assert ghost.status_code == 404 and "ghost" not in store.list_runs()
    assert not (root / "events" / "ghost.jsonl").exists()
    assert [e["event"] for e in read_events(store, RUN)].count("unpin") == 1
    # A metric that is not a finite number is a 400 (a huge integer was a 500), a bool too.
    for metrics in ({"v": 10**400}, {"acc": True}):
        r = client.post(
            "/api/actions/annotate",
            json={"run": RUN, "step": target, "metrics": metrics},
            headers=hdr,
        )
        assert r.status_code == 400 and "must be a" in r.json()["error"], r.text


WRITER = """
import sys, time, torch, stepvault
from stepvault import CheckpointManager, Every
root, n = sys.argv[1], int(sys.argv[2])
model = torch.nn.Linear(32, 32)
mgr = CheckpointManager(root, run="live", save=Every(steps=1), async_save=True)
for step in range(1, n + 1):
    with torch.no_grad():
        model.weight.add_(0.01)
    mgr.save(step, {"model": model}, metrics={"loss": 1.0 / step})
    time.sleep(0.05)
mgr.close()
"""


def test_pages_read_while_another_process_writes(trained, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(trained, root)
    client = TestClient(create_app(str(root)), base_url=BASE)
    n = 8
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(n)])
    tokens, seen = set(), set()
    try:
        deadline = time.time() + 120
        while writer.poll() is None and time.time() < deadline:
            tokens.add(client.get("/api/changes").json()["token"])
            r = client.get("/api/runs/live") if "live" in Store.open(root).list_runs() else None
            if r is not None:
                assert r.status_code == 200, r.text
                doc = r.json()
                assert not any(c["error"] for c in doc["checkpoints"])  # never a partial one
                seen.add(len(doc["checkpoints"]))
                assert client.get("/runs/live").status_code == 200
            assert client.get("/").status_code == 200
    finally:
        writer.wait(timeout=120)
    assert writer.returncode == 0
    final = client.get("/api/runs/live").json()
    assert [c["step"] for c in final["checkpoints"]] == list(range(1, n + 1))
    assert len(tokens) > 2 and len(seen) > 2  # the pages saw the run grow


def test_core_does_not_import_the_web_stack():
    code = (
        "import sys, stepvault, stepvault.cli.main; "
        "print(sorted(m for m in ('starlette', 'uvicorn', 'jinja2') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_stepvault_ui_serves_on_loopback(trained):
    port = free_port()
    proc = subprocess.Popen(
        [*UI_CMD, "--root", str(trained), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        body = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/store", timeout=5) as r:
                    body = json.loads(r.read())
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        assert body is not None and {r["run"] for r in body["runs"]} == {RUN, BROKEN}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_every_static_file_and_template_is_package_data():
    # A non-editable install ships only what pyproject's package-data names.
    import fnmatch

    import stepvault.ui

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    here = Path(stepvault.ui.__file__).parent
    project = Path(__file__).resolve().parents[1] / "pyproject.toml"
    globs = tomllib.loads(project.read_text())["tool"]["setuptools"]["package-data"]["stepvault.ui"]
    files = [p.relative_to(here).as_posix() for p in here.rglob("*") if p.is_file()]
    shipped = [f for f in files if not f.endswith((".py", ".pyc"))]
    assert "static/vendor/uPlot.iife.min.js" in shipped and "templates/run.html" in shipped
    for name in shipped:
        assert any(fnmatch.fnmatch(name, g) for g in globs), f"{name} is not package data"


def test_damage_found_after_a_page_was_shown_appears_once_the_memo_expires(
    trained, tmp_path, monkeypatch
):
    import stepvault.ui.app as ui_app

    root = tmp_path / "store"
    shutil.copytree(trained, root)
    client = TestClient(create_app(str(root)), base_url=BASE)
    step = Store.open(root).list_steps(RUN)[0]
    assert client.get(f"/api/runs/{RUN}").json()["checkpoints"][0]["error"] is None
    path = root / "runs" / RUN / "checkpoints" / f"{step}.json"
    data = bytearray(path.read_bytes())
    data[-4] ^= 1  # same size, same listing: the change token cannot see it
    path.write_bytes(bytes(data))
    monkeypatch.setattr(ui_app, "MEMO_SECONDS", 0.0)
    monkeypatch.setattr(ui_app, "RECHECK_SECONDS", 0.0)
    assert "checksum" in client.get(f"/api/runs/{RUN}").json()["checkpoints"][0]["error"]


def test_dedup_savings_are_never_negative():
    """Tiny states: the deduplicated bytes (with non-tensor state) exceed the tensors'
    logical bytes, and the store page printed "saved -2.0 KiB"."""
    from stepvault.ops.usage import StoreUsage

    assert StoreUsage(logical_bytes=1000, raw_bytes=3048).dedup_savings == 0
    assert StoreUsage(logical_bytes=5000, raw_bytes=3000).to_json()["dedup_savings_bytes"] == 2000
