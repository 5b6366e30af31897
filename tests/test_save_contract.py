"""One save contract, every entry point (issue 27: one save pipeline, one commit epilogue).

The restore half is tests/test_restore_contract.py. Here each save entry point
(``stepvault.save``, the local ``CheckpointManager`` synchronous and asynchronous, the
manager with a mem tier, and on a 2-rank gloo group a collective manager over DDP and
``stepvault.save``) trains and saves like a user's job on a real store, and then:

1. **summary row**: ``runs/<run>/summaries.log`` holds one checksummed row per committed
   manifest (local stores), so a listing parses no manifest;
2. **object list**: ``runs/<run>/objects.log`` records each manifest's objects, equal to
   the parsed manifest's table (GC's mark reads it instead of the manifest);
3. **events** (the managers): one ``save`` event per commit with its step, kind and sizes
   (rank 0's alone under a group); a failed save (a value that cannot be encoded, a store
   that turned read-only) logs ``save_failed``, commits nothing, and every earlier
   checkpoint still restores bitwise;
4. **xor bases listed**: a save straight into a store of xor delta objects (a cold tier's)
   lists every base of every delta it reuses, so the checkpoint survives GC after the run
   that wrote the bases is deleted;
5. **parent**: each manifest's ``parent_step`` is the previous committed step;
6. **fenced** (the local manager): once another process has taken the run's lease over, a
   commit is refused with ``LeaseLostError`` and nothing of it becomes visible.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
import save_contract_workers
import torch
from helpers import spawn_ranks
from test_restore_contract import _same, _snapshot, _state, _train
from test_xor_delta import same, save_run, stores

import stepvault
import stepvault.format.manifest as manifest_format
from stepvault import CheckpointManager
from stepvault.catalog import checkpoint_records
from stepvault.catalog.events import read_events
from stepvault.catalog.summaries import log_key, verified_body_digest
from stepvault.engine.object_lists import envelope_digest, load_object_lists
from stepvault.errors import LeaseLostError, UnsupportedTypeError
from stepvault.format import Manifest, parse_manifest
from stepvault.format.objects import parse_header
from stepvault.format.xor_codec import chain_of
from stepvault.manager.options import LeaseOptions, ManagerOptions, MemOptions
from stepvault.store import Store
from stepvault.store.lease import Lease
from stepvault.store.local import LocalBackend

RUN = "r"
STEPS = [1, 2, 3]


# --------------------------------------------------------------------- entry points
class Writer(Protocol):
    """One entry point opened on a store: saves steps of one run, then is closed."""

    #: the stores that hold its committed manifests (a mem tier's too)
    stores: list[Path]

    def save(self, step: int, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _PlainWriter:
    def __init__(self, root: Path, run: str) -> None:
        self.root, self.run, self.stores = root, run, [root]

    def save(self, step: int, state: dict[str, Any]) -> None:
        stepvault.save(self.root, state, run=self.run, step=step)

    def close(self) -> None:
        pass


class _ManagerWriter:
    def __init__(self, root: Path, run: str, **options: Any) -> None:
        self.mgr = CheckpointManager(root, run, lineage=False, **options)
        mem = self.mgr.mem_tier
        self.stores = [root] + ([Path(mem.path)] if mem is not None else [])

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.mgr.save(step, state, force=True)
        self.mgr.wait()  # an asynchronous save's error is raised here

    def close(self) -> None:
        self.mgr.close()


def _mem_manager(root: Path, run: str) -> Writer:
    """Every save into node memory and then the hot store (the default tier policy); the
    memory copies kept after close, to be checked like any store."""
    mem = root.parent / f"{root.name}-shm"
    return _ManagerWriter(root, run, tiers={"mem": MemOptions(path=mem, cleanup=False)})


@dataclass
class SaveEntry:
    name: str
    open: Callable[[Path, str], Writer]
    #: a manager: it logs ``save`` and ``save_failed`` events
    events: bool = True


ENTRY_POINTS = [
    SaveEntry("stepvault.save", _PlainWriter, events=False),
    SaveEntry("manager sync", lambda root, run: _ManagerWriter(root, run, async_save=False)),
    SaveEntry("manager async", lambda root, run: _ManagerWriter(root, run, async_save=True)),
    SaveEntry("mem tier manager", _mem_manager),
]
MANAGERS = [e for e in ENTRY_POINTS if e.events]


def _ids(entry: SaveEntry) -> str:
    return entry.name


def _save_steps(entry: SaveEntry, root: Path) -> tuple[Writer, dict[int, dict[str, Any]]]:
    """Train and save ``STEPS`` with ``entry`` (the writer left open); what each step saved."""
    writer = entry.open(root, RUN)
    state = _state()
    saved = {}
    for step in STEPS:
        _train(state, step)
        writer.save(step, state)
        saved[step] = _snapshot(state)
    return writer, saved


# ------------------------------------------------------------------- what the store holds
def summary_rows(path: Path, run: str) -> list[str]:
    """The body checksums named by the rows of ``run``'s summary log; each row's own
    checksum must hold (a torn or damaged row would be ignored by a listing)."""
    from stepvault.format.hashing import content_hash

    log = path / log_key(run)
    assert log.exists(), f"{log} is missing: the commits of {run!r} wrote no summary row"
    digests = []
    for line in log.read_bytes().splitlines():
        checksum, _, payload = line.partition(b" ")
        assert content_hash(payload).encode() == checksum, f"a damaged summary row: {line!r}"
        digest, _entry = json.loads(payload)
        digests.append(digest)
    return digests


@contextlib.contextmanager
def counting_parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count full manifest parses (``format.manifest._from_json``) inside the block."""
    calls: list[int] = []
    original = manifest_format._from_json

    def counting(doc: dict[str, Any]) -> Manifest:
        calls.append(1)
        return original(doc)

    with monkeypatch.context() as m:
        m.setattr(manifest_format, "_from_json", counting)
        yield calls


def check_commits(
    path: Path, run: str, steps: list[int], monkeypatch: pytest.MonkeyPatch
) -> dict[int, Manifest]:
    """Contract points 1, 2 and 5 for the store at ``path``, which must hold exactly
    ``steps`` of ``run``, each committed by one save; the parsed manifests."""
    store = Store.open(path)
    assert store.list_steps(run) == steps
    data = {s: store.read_manifest(run, s) for s in steps}
    parsed = {s: parse_manifest(d, f"{run}@{s}") for s, d in data.items()}
    where = f"{run} in {path}"
    # 5. each manifest's parent is the previous commit
    assert [parsed[s].parent_step for s in steps] == [None, *steps[:-1]], where
    # 1. one checksummed summary row per commit, for exactly these manifests
    assert sorted(summary_rows(path, run)) == sorted(
        str(verified_body_digest(d)) for d in data.values()
    ), where
    # 2. the object list recorded at commit is the manifest's table
    lists, _ = load_object_lists(store, run)
    assert len(lists) == len(steps), where
    for s in steps:
        assert sorted(lists[str(envelope_digest(data[s]))]) == sorted(parsed[s].objects), (where, s)
    # 1. so a listing (which compacts the rows) parses none of them; its numbers are theirs
    with counting_parses(monkeypatch) as parses:
        listed = stepvault.open(path).checkpoints(run)
    assert parses == [], f"{where}: a listing parsed {len(parses)} manifests"
    assert [(r.step, r.kind, r.logical_bytes, r.stored_bytes, r.new_bytes) for r in listed] == [
        (s, m.kind, m.logical_bytes, m.stored_bytes, int(m.stats["new_bytes"]))
        for s, m in parsed.items()
    ], where
    return parsed


def check_save_events(
    path: Path, run: str, parsed: dict[int, Manifest], pid: int
) -> list[dict[str, Any]]:
    """Contract point 3: one ``save`` event per commit, by process ``pid``, with the step,
    kind and sizes of its manifest; the run's events."""
    events = read_events(Store.open(path), run)
    saves = [e for e in events if e["event"] == "save"]
    assert [
        (e["step"], e["kind"], e["logical_bytes"], e["stored_bytes"], e["new_bytes"]) for e in saves
    ] == [
        (s, m.kind, m.logical_bytes, m.stored_bytes, int(m.stats["new_bytes"]))
        for s, m in parsed.items()
    ]
    assert {e["pid"] for e in saves} == {pid}
    return events


def restore_step(path: Path, run: str, step: int) -> dict[str, Any]:
    """``run@step`` of the store at ``path`` restored into a fresh state; its snapshot."""
    live = _state(seed=7)
    info = stepvault.restore(path, live, run=run, step=step, mem=False)
    assert info is not None and info.step == step
    return _snapshot(live)


# -------------------------------------------------------------------------- 1, 2, 5
@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=_ids)
def test_each_commit_writes_its_summary_row_object_list_and_parent(
    entry: SaveEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, saved = _save_steps(entry, tmp_path / "ck")
    writer.close()
    for path in writer.stores:  # the hot store, and node memory for the mem tier
        check_commits(path, RUN, STEPS, monkeypatch)
        for step in STEPS:
            assert _same(restore_step(path, RUN, step), saved[step]), (path, step)


# ---------------------------------------------------------------------------------- 3
@pytest.mark.parametrize("entry", MANAGERS, ids=_ids)
def test_a_manager_logs_one_save_event_per_commit(
    entry: SaveEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, _ = _save_steps(entry, tmp_path / "ck")
    writer.close()
    parsed = check_commits(tmp_path / "ck", RUN, STEPS, monkeypatch)
    events = check_save_events(tmp_path / "ck", RUN, parsed, os.getpid())
    assert not [e for e in events if e["event"] == "save_failed"]


@contextlib.contextmanager
def read_only_store() -> Iterator[None]:
    """Every new file of a local store fails as on a file system remounted read-only
    (objects, manifests, the mem tier's too); appends to logs still go through, as the
    event log must say what failed. (Tests run as root here: chmod would not stop a write.)"""

    def refuse(self: LocalBackend, key: str, parts: Any, *, durable: bool) -> Any:
        raise OSError(errno.EROFS, f"Read-only file system: {key}")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(LocalBackend, "_write_tmp", refuse)
        yield


FAILURES = ["unencodable value", "read-only store"]


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=_ids)
def test_a_failed_save_commits_nothing_and_every_earlier_checkpoint_restores(
    entry: SaveEntry, failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ck"
    writer = entry.open(root, RUN)
    state = _state()
    saved = {}
    for step in (1, 2):
        _train(state, step)
        writer.save(step, state)
        saved[step] = _snapshot(state)
    _train(state, 3)  # new bytes: the write has objects to store
    if failure == "unencodable value":
        with pytest.raises(UnsupportedTypeError, match=r"state\['bad'\]"):
            writer.save(3, {**state, "bad": object()})
    else:
        with read_only_store(), pytest.raises(OSError, match="Read-only"):
            writer.save(3, state)
    # The store works again: the next save commits, its parent the last commit (2).
    _train(state, 4)
    writer.save(4, state)
    saved[4] = _snapshot(state)
    writer.close()
    for path in writer.stores:
        store = Store.open(path)
        assert store.list_steps(RUN) == [1, 2, 4], path
        assert not list((path / "tmp").glob("*.part")), path
        check_commits(path, RUN, [1, 2, 4], monkeypatch)
        for step in (1, 2, 4):
            assert _same(restore_step(path, RUN, step), saved[step]), (path, step)
    if entry.events:
        parsed = {s: parse_manifest(Store.open(root).read_manifest(RUN, s)) for s in (1, 2, 4)}
        events = check_save_events(root, RUN, parsed, os.getpid())
        failed = [e for e in events if e["event"] == "save_failed"]
        assert [e["step"] for e in failed] == [3], failed
        want = "UnsupportedTypeError" if failure == "unencodable value" else "Read-only"
        assert want in failed[0]["error"]


# ---------------------------------------------------------------------------------- 4
def check_bases_listed(cold: Store, run: str) -> None:
    """Contract point 4 on ``run@1`` in ``cold``: it reuses xor deltas and lists the whole
    base chain of each."""
    direct = parse_manifest(cold.read_manifest(run, 1), f"{run}@1").objects
    deltas = [d for d, e in direct.items() if e.codec == "xor"]
    assert deltas, f"{run}: the save reused no delta object (the test proves nothing)"
    chain = {h for d in deltas for h in chain_of(parse_header(cold.read_object(d)).params)}
    assert chain, "the reused deltas name no base"
    assert chain <= set(direct), f"{run}: bases not listed: {sorted(chain - set(direct))}"


def collect_the_bases_run(cold: Store, cold_path: Path) -> None:
    """Delete the run that wrote the bases (``r``) and collect garbage at once."""
    for s in cold.list_steps("r"):
        cold.delete_manifest("r", s)
    result = stepvault.ops.collect_garbage(cold, grace_seconds=0)
    assert result.sweep.deleted  # something was collected: r's objects no one else names


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=_ids)
def test_a_save_into_a_delta_store_lists_the_bases_it_reuses(
    entry: SaveEntry, tmp_path: Path
) -> None:
    hot, tiers = stores(tmp_path, "xor")
    cold = tiers["cold"]
    save_run(hot, tiers, 3)  # r@1..3 copied to the cold tier: from r@2 on, xor deltas
    # The state of r@3 saved straight into the cold tier's store (not a tier copy): its
    # chunks are r@3's delta objects there, reused by content hash.
    ck = stepvault.open(hot).checkpoint("r", 3)
    same_state = {k: ck.tensor(k) for k in ck.tensor_names()}
    writer = entry.open(tmp_path / "cold", "direct")
    writer.save(1, {"state": same_state})
    writer.close()
    check_bases_listed(cold, "direct")
    collect_the_bases_run(cold, tmp_path / "cold")
    live = {"state": {k: torch.zeros_like(v) for k, v in same_state.items()}}
    info = stepvault.restore(tmp_path / "cold", live, run="direct", mem=False)
    assert info is not None and info.step == 1
    assert same(live["state"], same_state)


# ---------------------------------------------------------------------------------- 6
TAKE_OVER = """
import sys, time
from stepvault.errors import LeaseHeldError
from stepvault.store import Store
from stepvault.store.lease import acquire_lease

store = Store.open(sys.argv[1])
deadline = time.monotonic() + 60
while True:  # until the first writer's lease has gone stale
    try:
        lease = acquire_lease(store, sys.argv[2], stale_after=60)
        break
    except LeaseHeldError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("TOOK", flush=True)
sys.stdin.readline()  # hold the run until the parent has seen the commit refused
lease.release()
"""


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_commit_after_another_process_took_the_run_over_is_refused(
    async_save: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ck"
    mgr = CheckpointManager(
        root,
        RUN,
        async_save=async_save,
        options=ManagerOptions(lease=LeaseOptions(stale_after=1.0)),
        lineage=False,
    )
    state = _state()
    _train(state, 1)
    mgr.save(1, state, force=True)
    mgr.wait()
    # This writer's heartbeat stops (a paused process, a lost network): after the TTL,
    # another process takes the run over.
    monkeypatch.setattr(Lease, "renew", lambda self: None)
    other = subprocess.Popen(
        [sys.executable, "-c", TAKE_OVER, str(root), RUN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stderr is not None
        assert other.stdout.readline().strip() == "TOOK", other.stderr.read()
        _train(state, 2)
        with pytest.raises(LeaseLostError, match=rf"r@2 was refused.* pid {other.pid}"):
            mgr.save(2, state, force=True)
            mgr.wait()
        # Nothing of step 2 is visible: no manifest, no row, no object list, no event.
        store = Store.open(root)
        assert store.list_steps(RUN) == [1]
        assert len(summary_rows(root, RUN)) == 1  # (before a listing compacts the rows)
        assert len(load_object_lists(store, RUN)[0]) == 1
        assert [r.step for r in checkpoint_records(store, RUN)] == [1]
        assert not list((root / "tmp").glob("*.part"))
        saves = [e["step"] for e in read_events(store, RUN) if e["event"] == "save"]
        assert saves == [1]
        with pytest.raises(LeaseLostError):  # every later call: this writer must stop
            mgr.save(3, state, force=True)
    finally:
        other.communicate("\n", timeout=60)
    with contextlib.suppress(LeaseLostError):
        mgr.close()
    assert other.returncode == 0
    assert _same(restore_step(root, RUN, 1), _snapshot(_trained(1)))


def _trained(step: int) -> dict[str, Any]:
    state = _state()
    for s in range(1, step + 1):
        _train(state, s)
    return state


# ------------------------------------------------------------------ 2 ranks, collective
@pytest.fixture(scope="module")
def collective(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One 2-rank gloo job (tests/save_contract_workers.py ``task_contract``): a collective
    manager (run ``m``) and ``stepvault.save`` (run ``s``) save 3 steps each and fail one,
    restore every step; then both save ``r@3``'s state into the xor cold tier's store."""
    root = tmp_path_factory.mktemp("collective")
    hot, tiers = stores(root, "xor")
    save_run(hot, tiers, 3)
    spawn_ranks(save_contract_workers.run, 2, "contract", root, root / "out")
    return root, [json.loads((root / "out" / f"result{r}.json").read_text()) for r in range(2)]


def test_collective_saves_write_summary_rows_object_lists_and_parents(
    collective: tuple[Path, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = collective
    for run in ("m", "s"):  # the collective manager, stepvault.save under the group
        check_commits(root / "store", run, STEPS, monkeypatch)


def test_collective_manager_logs_from_rank_0_only(
    collective: tuple[Path, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, results = collective
    parsed = {s: parse_manifest(Store.open(root / "store").read_manifest("m", s)) for s in STEPS}
    events = check_save_events(root / "store", "m", parsed, results[0]["pid"])
    failed = [e for e in events if e["event"] == "save_failed"]
    assert [(e["step"], e["pid"]) for e in failed] == [(4, results[0]["pid"])]
    assert "UnsupportedTypeError" in failed[0]["error"]


def test_collective_failed_saves_keep_every_earlier_checkpoint(
    collective: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = collective
    for rank, got in enumerate(results):
        print(f"rank {rank}: {got}")  # the whole outcome, for a failing run
        # Refused at the call, as for one process: an UnsupportedTypeError naming the
        # value (it was DCP's CheckpointException from the rank writing it, a
        # BaseException, raised by the manager only at the next wait()).
        refused = {"at": 0, "type": "UnsupportedTypeError", "names_value": True}
        assert got["m_failed"] == got["s_failed"] == {**refused, "names_ranks": [0]}, rank
        # only rank 1 holds the value: every rank refuses, naming it (rank 0 did not hang)
        assert got["s_failed_on_rank1"] == {**refused, "names_ranks": [1]}, (rank, got)
        expected = {str(s): True for s in STEPS}
        assert got["restored_bitwise"] == {"m": expected, "s": expected}, (rank, got)
    store = Store.open(root / "store")
    assert store.list_steps("m") == store.list_steps("s") == STEPS
    assert not list((root / "store" / "tmp").glob("*.part"))


def test_collective_saves_keep_their_metadata(
    collective: tuple[Path, list[dict[str, Any]]],
) -> None:
    """``metadata=`` reaches the manifest under a group too (it was dropped: the DCP
    writer was never given it), and every rank's restore returns it decoded."""
    _, results = collective
    for rank, got in enumerate(results):
        for run in ("m", "s"):
            want = {str(s): {"entry": run, "step": s} for s in STEPS}
            assert got["metadata"][run] == want, (rank, run, got["metadata"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's, 1 process
def test_collective_saves_into_a_delta_store_list_the_bases_they_reuse(
    collective: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, _ = collective
    cold = Store.open(root / "cold")
    for run in ("direct-m", "direct-s"):
        assert parse_manifest(cold.read_manifest(run, 1)).sharded  # written through DCP
        check_bases_listed(cold, run)
    ck = stepvault.open(root / "hot").checkpoint("r", 3)
    expected = {k: ck.tensor(k) for k in ck.tensor_names()}
    collect_the_bases_run(cold, root / "cold")
    for run in ("direct-m", "direct-s"):
        live = {"state": {k: torch.zeros_like(v) for k, v in expected.items()}}
        info = stepvault.restore(root / "cold", live, run=run, mem=False)
        assert info is not None and info.step == 1, run
        assert same(live["state"], expected), run
