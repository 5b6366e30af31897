"""The dashboard over an S3 store (moto's real HTTP server): every page answers, the
events (one object per event on S3) are shown, and browsing writes no object."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
import torch
from starlette.testclient import TestClient

from stepvault import CheckpointManager, Every
from stepvault.ui import create_app


@pytest.mark.slow  # ~20 s: moto's server and a manager's S3 requests
def test_dashboard_over_s3_reads_and_writes_nothing(monkeypatch, s3, bucket):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    url = f"s3://{bucket}/store"
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(url, run="r", save=Every(steps=1), async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": model}, metrics={"loss": 1 / step})
    client = s3.client()

    def keys() -> dict[str, str]:
        listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        return {o["Key"]: o["ETag"] for o in listed}

    before = keys()
    app = TestClient(create_app(url), base_url="http://127.0.0.1")
    for page in ("/", "/runs/r", "/runs/r/checkpoints/3", "/registry", "/events?run=r"):
        assert app.get(page).status_code == 200, page
    run = app.get("/api/runs/r").json()
    assert [c["step"] for c in run["checkpoints"]] == [1, 2, 3]
    assert [s["step"] for s in run["saves"]] == [1, 2, 3]
    assert app.get("/api/changes").status_code == 200
    assert keys() == before
