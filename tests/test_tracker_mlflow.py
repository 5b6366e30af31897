"""MLflow points at stepvault checkpoints (issue 32), against a real ``mlflow server``
started here on 127.0.0.1 with a SQLite backend and a local artifact root.

Each committed checkpoint becomes an external LoggedModel of the active run (tags name the
checkpoint, metrics linked at its step, no tensor byte in the artifact root);
``stepvault.restore`` takes what MLflow hands back (``models:/ID``, ``models:/NAME@ALIAS``)
bitwise; promoting in stepvault sets the MLflow alias and an alias moved in MLflow is
refused; a dead tracking server neither fails nor stalls training.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings

import pytest
import torch

mlflow = pytest.importorskip("mlflow")

from helpers import flip_byte, free_port, object_path  # noqa: E402

import stepvault  # noqa: E402
from stepvault.catalog.events import read_events  # noqa: E402
from stepvault.errors import CheckpointNotFoundError, IntegrityError, RegistryError  # noqa: E402
from stepvault.integrations.mlflow import MLflowTracker, promote, sync_registry  # noqa: E402
from stepvault.manager.options import ManagerOptions  # noqa: E402
from stepvault.registry import Registry  # noqa: E402
from stepvault.store import Store  # noqa: E402

SERVER_START_TIMEOUT = 180  # a 2-core machine shared with other jobs: mlflow imports slowly


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free loopback port; yields its URL."""
    where = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(where / "server.log", "wb")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{where / 'mlflow.db'}",
            "--default-artifact-root",
            str(where / "artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=where,
    )
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"mlflow server did not start: {(where / 'server.log').read_text()}")
        time.sleep(0.5)
    yield url, where
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def tracking(mlflow_server, monkeypatch):
    url, where = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    mlflow.set_tracking_uri(url)
    yield url, where
    while mlflow.active_run() is not None:
        mlflow.end_run()


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "step": 0}


def _train(state: dict, mgr, steps: range) -> None:
    model, opt = state["model"], state["optimizer"]
    for step in steps:
        x = torch.randn(8, 16)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] = step + 1
        mgr.save(step + 1, state, metrics={"loss": loss.item(), "val_loss": 1.0 / (step + 1)})


def _same(a: dict, b: dict) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa) and a["step"] == b["step"]


def test_checkpoints_are_logged_models_and_restore_from_models_uri(tracking, tmp_path):
    url, where = tracking
    root = tmp_path / "ckpts"
    mlflow.set_experiment("stepvault-demo")
    state = _state(0)
    with mlflow.start_run(run_name="exp1") as run:
        tracker = MLflowTracker()
        mgr = stepvault.CheckpointManager(
            root,
            run="exp1",
            save=stepvault.Every(steps=2),
            options=ManagerOptions(hooks=(tracker,)),
        )
        _train(state, mgr, range(6))
        mgr.close()
    assert [s for s, _, _ in tracker.recorded] == [2, 4, 6], tracker.failed

    client = mlflow.MlflowClient()
    models = client.search_logged_models(
        experiment_ids=[run.info.experiment_id], order_by=[{"field_name": "creation_timestamp"}]
    )
    by_step = {int(m.tags["stepvault.step"]): m for m in models}
    assert sorted(by_step) == [2, 4, 6]
    store = Store.open(root)
    records = {r.step: r for r in stepvault.open(root).checkpoints("exp1")}
    for step, m in by_step.items():
        assert m.source_run_id == run.info.run_id
        assert m.tags["stepvault.uri"] == f"stepvault:{store.backend.url}#exp1@{step}"
        assert m.tags["stepvault.ref"] == f"exp1@{step}"
        assert m.tags["stepvault.manifest_blake3"] == records[step].manifest_id
        # metrics linked to the model at the checkpoint's step
        linked = {mm.key: (mm.value, mm.step) for mm in m.metrics or []}
        assert linked["val_loss"] == (pytest.approx(1.0 / step), step)
    # No tensor byte went to MLflow: the artifact root holds MLmodel files only.
    files = [p for p in (where / "artifacts").rglob("*") if p.is_file()]
    assert files and all(p.name == "MLmodel" for p in files)
    assert sum(p.stat().st_size for p in files) < 2000 * len(files)

    # The run's event log says where each checkpoint is referenced (the dashboard reads it).
    refs = [e for e in read_events(store, "exp1") if e["event"] == "tracker_ref"]
    assert [(e["step"], e["tracker"]) for e in refs] == [(s, "mlflow") for s in (2, 4, 6)]
    assert refs[-1]["ref"].startswith(f"{url}/#/experiments/{run.info.experiment_id}/models/m-")
    assert refs[-1]["name"] == by_step[6].name

    # What MLflow hands back restores the exact checkpoint, bitwise.
    fresh = _state(1)
    info = stepvault.restore(f"models:/{by_step[4].model_id}", fresh)
    assert info.step == 4
    reference = _state(2)
    stepvault.restore(root, reference, run="exp1", step=4)
    assert _same(fresh, reference)


def _three_tracked_checkpoints(tmp_path, experiment: str):
    """A store whose run ``r`` has checkpoints 1..3 logged by the tracker; its root."""
    root = tmp_path / "ckpts"
    mlflow.set_experiment(experiment)
    with mlflow.start_run():
        mgr = stepvault.CheckpointManager(
            root, run="r", options=ManagerOptions(hooks=(MLflowTracker(),))
        )
        _train(_state(0), mgr, range(3))
        mgr.close()
    return root


def test_registry_alias_follows_stepvault_and_mlflow_moves_are_refused(tracking, tmp_path):
    root = _three_tracked_checkpoints(tmp_path, "stepvault-registry")
    client = mlflow.MlflowClient()

    number = promote(root, "classifier", "r@2", "champion")
    mv = client.get_model_version_by_alias("classifier", "champion")
    assert str(mv.version) == str(number)
    assert mv.tags["stepvault.ref"] == "r@2"
    # the version's source is the LoggedModel the tracker logged for r@2 (not a new one)
    assert mv.source.startswith("models:/m-")
    logged = client.get_logged_model(mv.source.removeprefix("models:/"))
    assert logged.tags["stepvault.ref"] == "r@2" and logged.source_run_id is not None

    fresh, reference = _state(5), _state(6)
    assert stepvault.restore("models:/classifier@champion", fresh).step == 2
    stepvault.restore(root, reference, run="r", step=2)
    assert _same(fresh, reference)

    # Promote another version in stepvault: the MLflow alias moves with it.
    promote(root, "classifier", "r@3", "champion")
    assert client.get_model_version_by_alias("classifier", "champion").tags["stepvault.ref"] == (
        "r@3"
    )
    assert stepvault.restore("models:/classifier@champion", _state(7)).step == 3
    Registry(root).rollback("classifier", "champion")  # a rollback in stepvault, then sync
    assert sync_registry(root, "classifier") == {"champion": int(number)}

    # The reverse direction is refused, and nothing changes on either side.
    client.set_registered_model_alias("classifier", "champion", "2")
    refused = r"stepvault promote classifier RUN@STEP --alias champion"
    with pytest.raises(RegistryError, match=refused):
        promote(root, "classifier", "r@1", "champion")
    assert Registry(root).aliases("classifier") == {"champion": 1}
    assert client.get_model_version_by_alias("classifier", "champion").version == "2"


def test_the_cli_promote_and_rollback_with_mlflow_move_the_mlflow_alias(tracking, tmp_path):
    """``stepvault promote ... --mlflow`` (and rollback): the registered model of the same
    name follows a move made at the command line; a move made in MLflow is refused before
    stepvault changes; without --mlflow MLflow is not touched."""
    from helpers import cli

    root = _three_tracked_checkpoints(tmp_path, "stepvault-cli")
    client = mlflow.MlflowClient()

    done = cli(root, "promote", "ranker", "r@1", "--alias", "stable", "--mlflow")
    assert done.exit_code == 0, done.output
    assert "MLflow ranker@stable -> version 1" in done.output
    assert client.get_model_version_by_alias("ranker", "stable").tags["stepvault.ref"] == "r@1"
    done = cli(root, "promote", "ranker", "r@2", "--alias", "stable", "--mlflow")
    assert done.exit_code == 0, done.output
    assert client.get_model_version_by_alias("ranker", "stable").tags["stepvault.ref"] == "r@2"
    assert stepvault.restore("models:/ranker@stable", _state(3)).step == 2

    done = cli(root, "rollback", "ranker", "--alias", "stable", "--mlflow")
    assert done.exit_code == 0, done.output
    assert client.get_model_version_by_alias("ranker", "stable").tags["stepvault.ref"] == "r@1"

    # without --mlflow: stepvault moves, MLflow stays
    assert cli(root, "promote", "ranker", "r@3", "--alias", "stable").exit_code == 0
    assert client.get_model_version_by_alias("ranker", "stable").tags["stepvault.ref"] == "r@1"

    # a move made in MLflow: refused with the command that moves it, nothing changed
    client.set_registered_model_alias("ranker", "stable", "2")
    done = cli(root, "promote", "ranker", "r@2", "--alias", "stable", "--mlflow")
    assert done.exit_code == 2
    assert "stepvault promote ranker RUN@STEP --alias stable" in " ".join(done.output.split())
    assert Registry(root).aliases("ranker")["stable"] == 3  # r@3, from the plain promote
    assert client.get_model_version_by_alias("ranker", "stable").version == "2"


def test_a_ref_to_a_deleted_or_damaged_checkpoint_says_which_and_what_is_left(tracking, tmp_path):
    root = tmp_path / "ckpts"
    state = _state(0)
    mlflow.set_experiment("stepvault-broken")
    with mlflow.start_run():
        tracker = MLflowTracker()
        mgr = stepvault.CheckpointManager(root, run="r", options=ManagerOptions(hooks=(tracker,)))
        _train(state, mgr, range(3))
        mgr.close()
    client = mlflow.MlflowClient()
    ids = {
        int(m.tags["stepvault.step"]): m.model_id
        for m in client.search_logged_models(
            experiment_ids=[mlflow.get_experiment_by_name("stepvault-broken").experiment_id]
        )
    }
    os.remove(root / Store.manifest_key("r", 1))  # deleted behind the tracker's back
    live = _state(9)
    before = {k: v.clone() for k, v in live["model"].state_dict().items()}
    with pytest.raises(CheckpointNotFoundError, match=r"r@1 .*deleted.*r@2, r@3"):
        stepvault.restore(f"models:/{ids[1]}", live)
    vault = stepvault.open(root)
    only2 = sorted(set(vault.manifest("r", 2).objects) - set(vault.manifest("r", 3).objects))
    flip_byte(object_path(root, only2[0]))
    with pytest.raises(IntegrityError, match=r"r@2 .*damaged.*r@3"):
        stepvault.restore(f"models:/{ids[2]}", live)
    assert all(torch.equal(before[k], v) for k, v in live["model"].state_dict().items())
    shutil.rmtree(root / "quarantine", ignore_errors=True)


def test_a_dead_tracking_server_never_fails_or_stalls_training(tmp_path, monkeypatch):
    """Every call to a closed port fails fast; the hook retries off the training thread,
    then records tracker_failed; the saves and their stalls are those of no tracker."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    dead = f"http://127.0.0.1:{free_port()}"
    tracker = MLflowTracker(run_id="0" * 32, tracking_uri=dead, retries=2, backoff=0.05)
    state = _state(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = stepvault.CheckpointManager(
            tmp_path / "ckpts",
            run="r",
            options=ManagerOptions(hooks=(tracker,)),
        )
        _train(state, mgr, range(3))
        mgr.close()
    assert sorted(step for step, _ in tracker.failed) == [1, 2, 3]
    events = read_events(Store.open(tmp_path / "ckpts"), "r")
    assert [e["step"] for e in events if e["event"] == "save"] == [1, 2, 3]
    failed = [e for e in events if e["event"] == "tracker_failed"]
    assert [(e["step"], e["tracker"]) for e in failed] == [(s, "mlflow") for s in (1, 2, 3)]
    assert all("Connection" in e["error"] or "connect" in e["error"].lower() for e in failed)
    assert any("tracker_failed" in str(w.message) for w in caught)
    assert stepvault.restore(tmp_path / "ckpts", _state(3), run="r").step == 3


class _SilentServer:
    """A TCP server on loopback that accepts connections and never answers until
    released: a tracker behind a firewall that drops replies (the worst case: every call
    hangs rather than fails)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted.set()

    def release(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_hanging_tracker_neither_stalls_saves_nor_holds_close(tmp_path, monkeypatch):
    """The tracking server accepts and never replies: every save still commits while the
    hook's first call hangs, and close() gives up after close_timeout, recording each step
    as tracker_failed; the hook writes nothing after that, even once the call returns."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    server = _SilentServer()
    tracker = MLflowTracker(run_id="0" * 32, tracking_uri=server.url, close_timeout=1.0)
    state = _state(0)
    root = tmp_path / "ckpts"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mgr = stepvault.CheckpointManager(
                root, run="r", options=ManagerOptions(hooks=(tracker,))
            )
            _train(state, mgr, range(3))
            mgr.wait()  # every save committed...
            assert server.accepted.wait(60)
            # ...while the tracker's first call still hangs: nothing recorded, nothing failed
            assert tracker.recorded == [] and tracker.failed == []
            mgr.close()  # bounded by close_timeout, not by the hanging call
    finally:
        server.release()
    assert sorted(step for step, _ in tracker.failed) == [1, 2, 3]
    assert all("not recorded before close" in why for _, why in tracker.failed)
    time.sleep(0.5)  # the released call fails on the hook's thread: it must write nothing
    events = read_events(Store.open(root), "r")
    assert [e["step"] for e in events if e["event"] == "save"] == [1, 2, 3]
    assert sorted(e["step"] for e in events if e["event"] == "tracker_failed") == [1, 2, 3]
    assert not [e for e in events if e["event"] == "tracker_ref"]
    assert stepvault.restore(root, _state(3), run="r").step == 3


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.mark.slow
@pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason="needs chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
)
@pytest.mark.extended
def test_the_mlflow_ui_lists_stepvault_checkpoints(tracking, tmp_path):
    """The MLflow UI of the test server, in headless Chromium, lists one model per
    checkpoint with its metrics and the registered version. With
    ``STEPVAULT_MLFLOW_SCREENSHOT=docs/mlflow-ui.png`` it saves the screenshot of
    docs/mlflow-ui.png."""
    pytest.importorskip("selenium")
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, _ = tracking
    root = tmp_path / "ckpts"
    experiment = mlflow.set_experiment("llm-pretrain")
    state = _state(0)
    with mlflow.start_run(run_name="exp1"):
        mgr = stepvault.CheckpointManager(
            root,
            run="exp1",
            save=stepvault.Every(steps=100),
            options=ManagerOptions(hooks=(MLflowTracker(),)),
        )
        _train(state, mgr, range(500))
        mgr.close()
    promote(root, "pretrain-ckpt", "exp1@400", "champion")

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-dev-shm-usage",
        "--window-size=1900,700",
    ):
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    page = f"{url}/#/experiments/{experiment.experiment_id}/models"
    try:
        driver.get(page)
        wait = WebDriverWait(driver, 90)
        # A fresh profile opens MLflow 3's GenAI view; the checkpoints are "Model training"
        toggle = wait.until(
            lambda d: d.find_elements(By.XPATH, "//*[normalize-space(text())='Model training']")
        )
        toggle[0].click()
        driver.get(page)
        names = [f"exp1-{s}" for s in (100, 200, 300, 400, 500)]
        wait.until(lambda d: all(n in d.find_element(By.TAG_NAME, "body").text for n in names))
        for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
            button.click()  # the assistant's side panel: the table gets the width
        # the registered version and the metrics linked to each checkpoint are columns
        for text in ("pretrain-ckpt", "val_loss"):
            wait.until(lambda d, t=text: t in d.find_element(By.TAG_NAME, "body").text)
        target = os.environ.get("STEPVAULT_MLFLOW_SCREENSHOT")
        if target:
            time.sleep(1)  # let the table settle (fonts, column widths)
            driver.save_screenshot(target)
    finally:
        driver.quit()


def test_no_active_mlflow_run_is_refused_at_construction_and_leaves_the_run_free(tmp_path):
    assert mlflow.active_run() is None
    with pytest.raises(RuntimeError, match=r"mlflow.start_run\(\).*run_id="):
        stepvault.CheckpointManager(
            tmp_path / "ckpts", run="r", options=ManagerOptions(hooks=(MLflowTracker(),))
        )
    # nothing held: the run's lease was given back, the next manager starts at once
    with stepvault.CheckpointManager(tmp_path / "ckpts", run="r") as mgr:
        mgr.save(1, {"w": torch.zeros(3), "step": 1})
    with pytest.raises(TypeError, match=r"options\.hooks takes callables"):
        ManagerOptions(hooks=("not a hook",))
