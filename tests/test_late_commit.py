"""A stale writer's commit that reaches the store after a takeover is no checkpoint.

What the host campaign found (``stale_partition``, 1 of 30 trials on S3): writer A passed
the fence (the conditional renewal right before the manifest PUT), sent the PUT, and its
link went down; the lease went stale, B took the run over and committed; after the heal
A's PUT landed and A's checkpoint appeared among B's. S3 has no transaction over two keys,
so the server cannot refuse it: the fence rule does (FORMAT.md §8). Here A's manifest write
is held between the fence and the write on the store's real code path (a thread paused on
an Event around the backend's write of that one key), B takes over and commits, then A's
write goes through: no listing, ``ls``, ``verify`` or restore shows it, B's checkpoints
stay as B wrote them, B's restore takes B's newest, and the owner removes it.

Backends: S3 (the moto server the tests start: conditional requests) and a local disk whose
locks do not reach the other writer (a directory shared over NFS mounted ``nolock``: the
same store code, no ``flock`` between hosts). On a local disk with working locks the fence
holds the lock across check and rename, so no commit can land late there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from stepvault.catalog import checkpoint_records
from stepvault.cli.main import app
from stepvault.core.restore import restore
from stepvault.core.write import save
from stepvault.errors import CheckpointNotFoundError, LeaseLostError
from stepvault.manager.leasing import LeaseKeeper
from stepvault.manager.scope import fenced
from stepvault.ops.verify import verify_store
from stepvault.store import Store
from stepvault.store.fencing import manifest_stamp
from stepvault.store.fsspec_backend import open_fsspec
from stepvault.store.lease import acquire_lease
from stepvault.store.local import LocalBackend

TTL = 1.0  # lease stale_after: short, so the test pauses for a second only


class NolockBackend(LocalBackend):
    """A local directory whose locks do not exclude the other writer: what two hosts see
    of a share mounted ``nolock`` (each host's ``flock`` is local to it)."""

    exclusive_is_atomic = False

    def exclusive(
        self, key: str, timeout: float = 30.0, *, abandoned: Callable[[], bool] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.fixture(params=["s3", "nolock"])
def open_store(request, tmp_path) -> Callable[[], Store]:
    """Opens a new Store on one location at each call (another process's view)."""
    if request.param == "nolock":
        root = str(tmp_path / "store")
        os.makedirs(root, exist_ok=True)
        return lambda: Store.open(NolockBackend(root), create=True)
    s3 = request.getfixturevalue("s3")
    url = f"s3://{s3.new_bucket()}/store"
    return lambda: Store.open(open_fsspec(url, endpoint_url=s3.endpoint), create=True)


def weights(value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(value))}


@contextlib.contextmanager
def held_write(store: Store, step: int) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold ``store``'s write of the manifest of ``step`` after the fence passed: the
    backend call that makes it visible (S3: the PUT; a local disk: the rename) waits until
    ``release`` is set. Yields ``(reached, release)``."""
    reached, release = threading.Event(), threading.Event()
    backend = store.backend
    suffix = f"/checkpoints/{step}.json"
    name = "_make_visible" if isinstance(backend, LocalBackend) else "put_atomic"
    original = getattr(backend, name)

    def paused(key: str, *args: Any, **kwargs: Any) -> Any:
        if key.endswith(suffix):
            reached.set()
            assert release.wait(60), "the test never released the held write"
        return original(key, *args, **kwargs)

    setattr(backend, name, paused)
    try:
        yield reached, release
    finally:
        release.set()
        delattr(backend, name)


def late_save(
    store: Store, step: int, *, overwrite: bool = False
) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            save(store, weights(100 + step), run="r", step=step, overwrite=overwrite)
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def takeover(open_store: Callable[[], Store]) -> Store:
    time.sleep(TTL + 0.3)  # A is stuck in its write: its lease goes stale
    store = open_store()
    fenced(acquire_lease(store, "r", stale_after=60))
    return store


def restored_value(store: Store) -> tuple[int, float]:
    state = {"w": torch.zeros(64)}
    info = restore(store, state, run="r", mem=False)
    assert info is not None
    return info.step, float(state["w"][0])


def test_a_manifest_landing_after_a_takeover_is_never_a_checkpoint(open_store, tmp_path):
    a = open_store()
    fenced(acquire_lease(a, "r", stale_after=TTL))
    for step in (1, 2):
        save(a, weights(step), run="r", step=step)
    with held_write(a, 3) as (reached, release):
        thread, errors = late_save(a, 3)
        assert reached.wait(60)  # A passed the fence: its PUT is on its way
        b = takeover(open_store)
        for step in (4, 5):
            save(b, weights(step), run="r", step=step)
        release.set()  # the link heals: A's manifest reaches the store
        thread.join(60)
    # The store took A's write (S3 cannot refuse it); A learns at once that it does not count.
    assert len(errors) == 1 and isinstance(errors[0], LeaseLostError)
    assert "reached the store after that takeover" in str(errors[0])
    raw = open_store()
    assert raw.listed_steps("r") == [1, 2, 3, 4, 5]  # the file is there...
    late = raw.backend.read_bytes(raw.manifest_key("r", 3))
    assert manifest_stamp(late)["epoch"] < manifest_stamp(raw.read_manifest("r", 4))["epoch"]

    # ...and no reader counts it: listing, records, explicit read, verify, restore, ls.
    reader = open_store()
    assert reader.list_steps("r") == [1, 2, 4, 5]
    assert [r.step for r in checkpoint_records(reader, "r")] == [1, 2, 4, 5]
    assert "landed after takeover" in reader.stale_commits("r")[3]
    with pytest.raises(CheckpointNotFoundError, match="landed after takeover by"):
        reader.read_manifest("r", 3)
    report = verify_store(reader, run="r")
    assert [c.step for c in report.checkpoints] == [1, 2, 4, 5] and report.ok
    assert restored_value(reader) == (5, 5.0)
    with pytest.raises(CheckpointNotFoundError):
        restore(reader, {"w": torch.zeros(64)}, run="r", step=3, mem=False)
    if isinstance(reader.backend, LocalBackend):
        listing = CliRunner().invoke(app, ["ls", "r", "--root", reader.backend.url, "--json"])
        assert listing.exit_code == 0, listing.output
        assert '"step": 3' not in listing.output and '"step": 5' in listing.output

    # B's checkpoints are B's, byte for byte; B goes on and restores its own newest.
    for step in (4, 5):
        state = {"w": torch.zeros(64)}
        restore(reader, state, run="r", step=step, mem=False)
        assert float(state["w"][0]) == step
        assert manifest_stamp(reader.read_manifest("r", step))["token"] == b.fences["r"].token  # type: ignore[attr-defined]
    save(b, weights(6), run="r", step=6)
    assert restored_value(b) == (6, 6.0)

    # The owner removes the late manifest (the heartbeat does it, with an event).
    events: list[tuple[str, dict[str, Any]]] = []
    keeper = LeaseKeeper(b.fences["r"], "r", 60, event=lambda e, **f: events.append((e, f)))  # type: ignore[arg-type]
    removed = keeper.remove_stale_commits()
    assert [s for s, _ in removed] == [3]
    assert events and events[0][0] == "stale_commit_removed" and events[0][1]["step"] == 3
    assert open_store().listed_steps("r") == [1, 2, 4, 5, 6]
    # B may now commit step 3 itself.
    save(b, weights(3), run="r", step=3)
    assert open_store().list_steps("r") == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_late_manifest_never_replaces_the_new_owners_checkpoint(open_store, overwrite):
    """A's held write is of a step that B commits first: create-only keeps B's, also for
    ``overwrite=True`` (the manager's saves), which commits create-only when the step is
    not there; A learns that it lost the run."""
    a = open_store()
    fenced(acquire_lease(a, "r", stale_after=TTL))
    save(a, weights(1), run="r", step=1)
    with held_write(a, 2) as (reached, release):
        thread, errors = late_save(a, 2, overwrite=overwrite)
        assert reached.wait(60)
        b = takeover(open_store)
        save(b, weights(2), run="r", step=2)
        mine = b.backend.read_bytes(b.manifest_key("r", 2))
        release.set()
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], LeaseLostError), errors
    reader = open_store()
    assert reader.backend.read_bytes(reader.manifest_key("r", 2)) == mine  # B's, intact
    assert reader.list_steps("r") == [1, 2]
    assert restored_value(reader) == (2, 2.0)


def test_a_late_manifest_that_landed_first_does_not_block_the_owners_commit(open_store):
    a = open_store()
    fenced(acquire_lease(a, "r", stale_after=TTL))
    save(a, weights(1), run="r", step=1)
    with held_write(a, 2) as (reached, release):
        thread, errors = late_save(a, 2)
        assert reached.wait(60)
        b = takeover(open_store)
        release.set()  # A's late manifest of step 2 lands before B commits step 2
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], LeaseLostError)
    assert open_store().list_steps("r") == [1]
    save(b, weights(2), run="r", step=2)  # replaces the late manifest, not refused
    assert [s for _, s, _ in b.stale_removed] == [2]
    reader = open_store()
    assert reader.list_steps("r") == [1, 2]
    assert restored_value(reader) == (2, 2.0)


def test_a_late_overwrite_of_a_step_visible_at_the_takeover_is_no_checkpoint(open_store):
    """The gap the step list left (RELIABILITY "Known limits"): A re-saves step 2 with
    ``overwrite=True`` and its write is held past B's takeover, whose record listed step 2
    as visible. The record now lists each visible step's version: A's replacement is
    refused on every read, so no restore returns A's post-takeover state."""
    a = open_store()
    fenced(acquire_lease(a, "r", stale_after=TTL))
    for step in (1, 2):
        save(a, weights(step), run="r", step=step)
    with held_write(a, 2) as (reached, release):
        errors: list[BaseException] = []

        def overwrite() -> None:
            try:
                save(a, weights(102), run="r", step=2, overwrite=True)
            except BaseException as exc:  # reported to the test
                errors.append(exc)

        thread = threading.Thread(target=overwrite, daemon=True)
        thread.start()
        assert reached.wait(60)  # A passed the fence: its PUT is on its way
        b = takeover(open_store)
        save(b, weights(3), run="r", step=3)
        release.set()  # A's replacement of step 2 lands after the takeover
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], LeaseLostError)
    record = b.fence_records("r").record(b.fences["r"].epoch)  # type: ignore[attr-defined]
    assert record["visible"] == [1, 2] and set(record["versions"]) == {"1", "2"}
    raw = open_store()
    late = raw.backend.read_bytes(raw.manifest_key("r", 2))
    assert manifest_stamp(late)["epoch"] < b.fences["r"].epoch  # A's bytes are there...  # type: ignore[attr-defined]

    reader = open_store()  # ...and no read counts them
    with pytest.raises(CheckpointNotFoundError, match="replaced the checkpoint visible at"):
        reader.read_manifest("r", 2)
    with pytest.raises(CheckpointNotFoundError):
        restore(reader, {"w": torch.zeros(64)}, run="r", step=2, mem=False)
    records = {r.step: r for r in checkpoint_records(reader, "r")}
    assert records[1].valid and records[3].valid and not records[2].valid
    # verify names it: the version the takeover saw was replaced on the store
    report = verify_store(reader, run="r")
    bad = {c.step: c.problems for c in report.checkpoints if c.problems}
    assert list(bad) == [2] and "replaced the checkpoint visible at" in bad[2][0]
    assert restored_value(reader) == (3, 3.0)
    # B's commit of step 2 replaces it (create-only: the refused manifest is removed first).
    save(b, weights(2), run="r", step=2)
    state = {"w": torch.zeros(64)}
    restore(open_store(), state, run="r", step=2, mem=False)
    assert float(state["w"][0]) == 2.0


def test_fence_records_without_versions_read_as_before(tmp_path):
    """A record written by 1.2 (no ``versions``) judges a visible step by its number."""
    from stepvault.store.fencing import FenceRecords

    v12 = {"epoch": 2, "visible": [1, 2], "owner": {"host": "h", "pid": 1}}
    fences = FenceRecords([1, 2], lambda epoch: v12)
    old = {"epoch": 1, "token": "t"}
    assert fences.refusal(2, old, version="anything") is None
    assert "landed after takeover" in str(fences.refusal(3, old, version="x"))
    v13 = {**v12, "versions": {"1": "aa", "2": "bb"}}
    fences = FenceRecords([1, 2], lambda epoch: v13)
    assert fences.refusal(2, old, version="bb") is None
    assert "replaced the checkpoint" in str(fences.refusal(2, old, version="cc"))
    assert fences.refusal(2, old, version="cc", memory=True) is None  # memory: other files
    assert fences.refusal(2, {"epoch": 2, "token": "u"}, version="cc") is None  # the owner's


def test_old_stores_and_runs_without_a_lease_read_as_before(tmp_path):
    """Manifests without a stamp (no lease, or a stepvault before stamps) always count."""
    store = Store.open(tmp_path / "s", create=True)
    save(store, weights(1), run="r", step=1)  # no lease: no stamp
    assert manifest_stamp(store.read_manifest("r", 1)) is None
    lease = fenced(acquire_lease(store, "r", stale_after=60))
    save(store, weights(2), run="r", step=2)
    assert manifest_stamp(store.read_manifest("r", 2)) == {"epoch": 1, "token": lease.token}
    lease.release()
    again = fenced(acquire_lease(Store.open(tmp_path / "s"), "r", stale_after=60))
    assert again.epoch == 2  # a new epoch even after a release
    reader = Store.open(tmp_path / "s")
    assert reader.list_steps("r") == [1, 2] and not reader.stale_commits("r")
    assert restored_value(reader) == (2, 2.0)


def test_a_stale_writers_save_in_its_nodes_memory_is_not_restored_after_a_takeover(tmp_path):
    """Memory commits obey the same fence: writer A (a mem tier on its node) loses the run
    to B on another node while its save is in flight; the save lands in A's node memory
    (the disk commit is refused). A relaunch on A's node must resume from B's newest
    checkpoint on disk, not from A's late memory copy at a newer step."""
    from stepvault import CheckpointManager
    from stepvault.manager.options import LeaseOptions, ManagerOptions, MemOptions

    hot, shm = tmp_path / "ck", tmp_path / "shm-node-a"

    def opts(stale: float) -> ManagerOptions:
        return ManagerOptions(lease=LeaseOptions(stale_after=stale))

    mem = {"mem": MemOptions(path=shm, cleanup=False)}
    a = CheckpointManager(hot, "r", tiers=mem, options=opts(TTL))
    for step in (1, 2):
        a.save(step, weights(step), force=True)
        a.wait()
    a._p.lease.stop()  # A's heartbeat stops (its node cut off, or paused)
    time.sleep(TTL + 0.3)
    b = CheckpointManager(hot, "r", options=opts(60))  # another node: no memory of A's
    b.save(3, weights(3), force=True)
    b.wait()
    with pytest.raises(LeaseLostError):  # in memory first, then refused on disk
        a.save(4, weights(4), force=True)
        a.wait()
    with contextlib.suppress(LeaseLostError):
        a.close()
    b.close()
    assert Store.open(hot).list_steps("r") == [1, 2, 3]

    # The relaunch on A's node: B's step 3 from disk, not A's step 4 from memory.
    state = weights(0)
    info = restore(hot, state, run="r", mem=str(shm))
    assert info is not None and (info.step, float(state["w"][0])) == (3, 3.0)
    with CheckpointManager(hot, "r", tiers=mem, options=opts(60)) as c:
        state = weights(0)
        info = c.restore(state)
        assert info is not None and (info.step, float(state["w"][0])) == (3, 3.0)
        assert 4 in c.mem_tier.store.listed_steps("r")  # A's late copy is there...
        assert 4 not in c.mem_tier.steps()  # ...and listed nowhere
        # A's memory copies from before the takeover still count (they were on disk).
        state = weights(0)
        assert c.restore(state, step=2) is not None and float(state["w"][0]) == 2.0


def test_thinning_under_a_lease_keeps_later_attachments(tmp_path):
    """The stamp is in the committed file, whose BLAKE3 attachment records bind to: a
    thinning by the lease holder rebinds them to the file as it is written."""
    from stepvault.catalog import apply_retention
    from stepvault.catalog.attachments import attach_after, checkpoint_attachments
    from stepvault.policy import KeepLast, ThinAfter

    store = Store.open(tmp_path / "s", create=True)
    fenced(acquire_lease(store, "r", stale_after=60))
    for step in (1, 2):
        save(store, {"model": torch.nn.Linear(4, 4), "step": step}, run="r", step=step)
    attach_after(store, "r", 1, {"config.json": b'{"hidden": 4}'})
    keep = KeepLast(2) | ThinAfter(steps=1)
    assert apply_retention(store, "r", keep, checkpoint_records(store, "r")).thinned == [1]
    assert manifest_stamp(store.read_manifest("r", 1)) == store.fences["r"].stamp()  # type: ignore[attr-defined]
    assert checkpoint_attachments(store, "r", 1)["config.json"].read() == b'{"hidden": 4}'
