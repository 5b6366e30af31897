"""The fsspec backend against a real S3-compatible HTTP server (moto's server mode on
127.0.0.1) through s3fs/aiobotocore, with HTTP-level fault injection; and memory://.

The ``s3`` and ``bucket`` fixtures (tests/conftest.py) skip the S3 tests where moto or s3fs
is missing; the memory:// tests need neither and still run."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from helpers import same_weights
from s3_server import FaultProxy

import stepvault
from stepvault import CheckpointManager, ops
from stepvault.catalog.events import log_event, read_events
from stepvault.errors import CheckpointExistsError
from stepvault.store import Store, backend_for
from stepvault.store.fsspec_backend import FsspecBackend, open_fsspec
from stepvault.store.lease import LeaseHeldError, acquire_lease


def backend(s3, bucket, endpoint=None, **opts) -> FsspecBackend:
    return open_fsspec(f"s3://{bucket}/store", endpoint_url=endpoint or s3.endpoint, **opts)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def test_url_opens_fsspec_backend_and_local_stays_local(s3, bucket, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    b = backend_for(f"s3://{bucket}/a/b")
    assert isinstance(b, FsspecBackend) and b.root == f"{bucket}/a/b"
    assert type(backend_for(tmp_path)).__name__ == "LocalBackend"
    assert type(backend_for(f"file://{tmp_path}")).__name__ == "LocalBackend"


def test_create_if_absent_is_decided_by_the_server(s3, bucket):
    b = backend(s3, bucket)
    b.put_atomic("runs/r/checkpoints/1.json", [b"one"], overwrite=False)
    # The same bytes again: a retried PUT whose first attempt went through; not an error.
    b.put_atomic("runs/r/checkpoints/1.json", [b"one"], overwrite=False)
    with pytest.raises(FileExistsError):
        b.put_atomic("runs/r/checkpoints/1.json", [b"two"], overwrite=False)
    assert b.read_bytes("runs/r/checkpoints/1.json") == b"one"
    # Visible to a plain S3 client too: the condition is enforced server-side.
    client = s3.client()
    with pytest.raises(client.exceptions.ClientError, match=r"PreconditionFailed|412"):
        client.put_object(
            Bucket=bucket, Key="store/runs/r/checkpoints/1.json", Body=b"x", IfNoneMatch="*"
        )


def test_concurrent_commits_of_one_step_have_exactly_one_winner(s3, bucket):
    store = Store.open(backend(s3, bucket), create=True)
    wins, losses = [], []

    def commit(i: int) -> None:
        try:
            store.commit_manifest("r", 7, f"writer {i}".encode(), overwrite=False)
            wins.append(i)
        except CheckpointExistsError:
            losses.append(i)

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 7
    assert store.read_manifest("r", 7) == f"writer {wins[0]}".encode()


def test_save_restore_verify_gc_on_s3_url(s3, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    url = f"s3://{bucket}/ckpts"
    m = model(1)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    info = stepvault.save(url, {"model": m, "opt": opt}, run="r", step=10, metrics={"loss": 1.5})
    again = stepvault.save(url, {"model": m, "opt": opt}, run="r", step=20)
    assert info.new_bytes > 0 and again.new_bytes == 0  # dedup on S3 too
    m2 = model(2)
    opt2 = torch.optim.AdamW(m2.parameters())
    restored = stepvault.restore(url, {"model": m2, "opt": opt2}, run="r")
    assert restored.step == 20 and same_weights(m, m2)
    assert opt2.state_dict()["state"][0]["step"] == 1
    assert stepvault.open(url).checkpoint("r@10").metrics == {"loss": 1.5}
    report = ops.verify(url, deep=True)
    assert report.ok and report.objects_checked > 0
    # GC: an orphan object past the grace period goes; referenced ones stay.
    store = Store.open(url)
    store.backend.put_atomic(Store.object_key("ab" * 32), [b"orphan"])
    swept = ops.collect_garbage(store, grace_seconds=0)
    assert swept.sweep.deleted == ["ab" * 32]
    assert ops.verify(url, deep=True).ok


def test_touch_refreshes_mtime_for_gc_grace(s3, bucket):
    import time

    b = backend(s3, bucket)
    b.put_atomic("objects/aa/x", [b"data"])
    before = b.mtime("objects/aa/x")
    time.sleep(1.1)  # S3 LastModified has one-second resolution
    b.touch("objects/aa/x")
    assert b.mtime("objects/aa/x") > before
    assert b.read_bytes("objects/aa/x") == b"data"


def test_big_objects_use_parallel_multipart_and_stay_atomic(s3, bucket):
    b = backend(s3, bucket, part_size=5 << 20)
    data = bytes(range(256)) * (48 << 12)  # 12 MiB: three 5 MiB parts
    b.put_atomic("objects/bb/big", [data[: 1 << 20], data[1 << 20 :]], overwrite=False)
    head = s3.client().head_object(Bucket=bucket, Key="store/objects/bb/big")
    assert "-" in head["ETag"]  # a multipart ETag ("<md5>-<parts>")
    assert b.read_bytes("objects/bb/big") == data
    assert b.read_range("objects/bb/big", 5 << 20, 10) == data[5 << 20 : (5 << 20) + 10]
    with pytest.raises(FileExistsError):  # the condition also guards CompleteMultipartUpload
        b.put_atomic("objects/bb/big", [data[::-1]], overwrite=False)


def test_events_and_leases_on_s3(s3, bucket):
    store = Store.open(backend(s3, bucket), create=True)
    for i in range(5):
        log_event(store, "r", "tick", i=i)
    assert [e["i"] for e in read_events(store, "r")] == list(range(5))
    # One object per event (an object store cannot append in place).
    assert len(store.backend.list("events/r")) == 5
    lease = acquire_lease(store, "r")
    with pytest.raises(LeaseHeldError):
        acquire_lease(store, "r")
    lease.renew()
    lease.release()
    acquire_lease(store, "r").release()


def test_manager_on_s3(s3, bucket):
    root = backend(s3, bucket)
    m = model(3)
    with CheckpointManager(root, "run", keep=stepvault.policy.KeepLast(2)) as mgr:
        for step in range(1, 5):
            with torch.no_grad():
                m[0].weight.add_(1.0)
            mgr.save(step, {"model": m})
    m2 = model(4)
    with CheckpointManager(root, "run") as mgr:
        assert mgr.restore({"model": m2}).step == 4
        assert [e["event"] for e in mgr.events()].count("save") == 4
    assert Store.open(root).list_steps("run") == [3, 4] and same_weights(m, m2)


def test_ten_percent_of_requests_fail_and_saves_and_restores_still_succeed(s3, bucket):
    proxy = FaultProxy(s3.endpoint, rate=0.10, seed=5).start()
    try:
        root = backend(s3, bucket, endpoint=proxy.endpoint)
        m = model(5)
        saved = {}
        for step in range(1, 7):
            with torch.no_grad():
                m[0].weight.add_(0.5)
            stepvault.save(root, {"model": m}, run="r", step=step)
            saved[step] = {k: v.clone() for k, v in m.state_dict().items()}
        for step, expected in saved.items():
            m2 = model(6)
            stepvault.restore(root, {"model": m2}, run="r", step=step)
            assert all(torch.equal(expected[k], v) for k, v in m2.state_dict().items())
        counts = dict(proxy.counts)
    finally:
        proxy.stop()
    # The faults really happened, of every kind, including lost responses.
    assert counts["requests"] > 60
    failed = sum(counts.get(k, 0) for k in FaultProxy.FAULTS)
    assert failed >= 0.05 * counts["requests"]
    assert all(counts.get(k, 0) > 0 for k in FaultProxy.FAULTS), counts
    assert ops.verify(backend(s3, bucket), deep=True).ok


def test_permanent_failure_is_a_clear_error_and_commits_nothing(s3, bucket):
    good = backend(s3, bucket)
    m = model(7)
    stepvault.save(good, {"model": m}, run="r", step=1)
    # Every request fails from now on: retries run out, the error surfaces.
    proxy = FaultProxy(s3.endpoint, rate=1.0, seed=1).start()
    proxy.FAULTS = ("503",)  # type: ignore[misc]
    try:
        bad = backend(
            s3, bucket, endpoint=proxy.endpoint, config_kwargs={"retries": {"max_attempts": 2}}
        )
        bad.fs.retries = 1
        with torch.no_grad():
            m[0].weight.add_(1.0)
        with pytest.raises(OSError, match=r"reduce your request rate|SlowDown|503"):
            stepvault.save(bad, {"model": m}, run="r", step=2)
    finally:
        proxy.stop()
    assert Store.open(good).list_steps("r") == [1]
    m2 = model(8)
    assert stepvault.restore(good, {"model": m2}, run="r").step == 1


def test_memory_backend_roundtrip():
    url = f"memory://sv-{uuid.uuid4().hex[:8]}"
    m = model(9)
    stepvault.save(url, {"model": m}, run="r", step=1)
    with pytest.raises(CheckpointExistsError):
        stepvault.save(url, {"model": m}, run="r", step=1)
    m2 = model(10)
    assert stepvault.restore(url, {"model": m2}, run="r").step == 1 and same_weights(m, m2)
    store = Store.open(url)
    log_event(store, "r", "x")
    assert [e["event"] for e in read_events(store, "r")] == ["x"]
    assert ops.verify(url, deep=True).ok


def test_stores_on_one_url_share_one_client_and_a_forked_child_makes_its_own(s3, bucket):
    """Opening the store again (every ``stepvault.restore(url)``, CLI or dashboard call)
    reuses the S3 client and its connections instead of paying ~0.1 s for new ones; a
    forked child (a DataLoader worker) never uses its parent's and still reads the store."""
    import multiprocessing

    from stepvault.store import fs_cache

    url = f"s3://{bucket}/shared"
    opts = {"endpoint_url": s3.endpoint}
    stepvault.save(backend_for(url, **opts), {"model": model(3)}, run="r", step=1)
    first = backend_for(url, **opts)
    assert backend_for(url, **opts).fs is first.fs
    assert backend_for(f"s3://{bucket}/other", **opts).fs is first.fs  # a prefix: same client
    assert open_fsspec(url, endpoint_url=s3.endpoint, anon=False).fs is not first.fs

    def child(queue) -> None:
        inherited = len(fs_cache._filesystems)
        m = model(0)
        step = stepvault.restore(backend_for(url, **opts), {"model": m}, run="r").step
        queue.put((inherited, step, same_weights(m, model(3))))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    assert queue.get(timeout=60) == (0, 1, True)
    proc.join(30)
    assert proc.exitcode == 0
    assert backend_for(url, **opts).fs is first.fs  # the parent's is still its own


def test_missing_credentials_are_a_clear_error(s3, bucket, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(OSError, match=r"NoCredentialsError.*AWS_ACCESS_KEY_ID"):
        stepvault.save(backend(s3, bucket), {"model": model(11)}, run="r", step=1)


def test_second_save_reuses_the_parent_object_table_with_few_requests(s3, bucket):
    """A reused chunk costs a touch (server-side copy) and one existence check: its size
    and codec come from the parent manifest, not from HEAD and ranged GET requests."""
    proxy = FaultProxy(s3.endpoint, rate=0.0).start()
    try:
        root = Store.open(
            backend(s3, bucket, endpoint=proxy.endpoint),
            create=True,
            defaults={"chunk_size": 256 << 10, "small_tensor": 64 << 10, "codec": "raw"},
        )
        torch.manual_seed(0)
        state = {f"w{i}": torch.randn(512, 512) for i in range(4)}  # 16 chunks of 256 KiB
        stepvault.save(root, state, run="r", step=1)
        first = len(proxy.requests)
        info = stepvault.save(root, state, run="r", step=2)
        second = proxy.requests[first:]
    finally:
        proxy.stop()
    assert info.new_bytes == 0 and info.objects == 16
    on_objects = [(m, c) for m, path, c in second if "/objects/" in path]
    copies = sum(1 for m, c in on_objects if c)
    heads = sum(1 for m, c in on_objects if m == "HEAD")
    gets = sum(1 for m, c in on_objects if m == "GET")
    assert copies == 16  # the touch that keeps GC's grace period honest
    assert gets == 0  # no header reads: the parent manifest records each codec
    assert heads <= 16  # one existence check after the writes (a GC may have raced)
    assert len(on_objects) <= 2 * 16
