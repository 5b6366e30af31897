"""The ``mem`` tier: checkpoints committed into node shared memory (``/dev/shm`` or another
tmpfs), so they outlive the training process (SIGKILL, a torchrun restart) but not the
machine.

It is an ordinary stepvault store (objects, then the manifest by atomic rename) in the
directory ``<mem root>/<store key>-<run>``: the key is derived from the hot store (its URL
and creation time), so two jobs never share one, and a restarted job finds its own. The
directory holds ``owner.json`` (pid, host, hot store URL, run) so that a stale mem tier of
a dead job can be reclaimed (:func:`reclaim_stale`). Under a process group each rank owns
``<key>-<run>+rank<r>`` and the node's ranks share ``<key>-<run>+peers`` (the replicas it
keeps for its buddy node); both carry an owner record too, so listing and reclaiming see
them (``manager/rank_memory.py``).

The memory budget is never exceeded: before a commit the writer asks :meth:`MemTier.
make_room` for the save's size (an upper bound: the raw bytes plus headers), which evicts
the oldest mem copies (those already on disk first); a save that cannot fit is not written
to mem (the caller writes it to disk and logs an event).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..engine.gc import sweep
from ..errors import StepvaultError
from ..store import LocalBackend, Store
from ..store.lease_file import pid_alive

MEM = "mem"
MEM_ROOT_ENV = "STEPVAULT_MEM_ROOT"
OWNER_KEY = "owner.json"
#: Settings the mem store inherits from the hot store (its codec is always raw: speed).
_INHERITED = ("chunk_size", "small_tensor", "bundle_size")


def default_mem_root() -> str:
    """``$STEPVAULT_MEM_ROOT``, else ``/dev/shm/stepvault`` (where /dev/shm exists)."""
    env = os.environ.get(MEM_ROOT_ENV)
    if env:
        return os.path.abspath(env)
    if os.path.isdir("/dev/shm"):
        return "/dev/shm/stepvault"
    raise StepvaultError(
        "no /dev/shm on this machine: give the mem tier a tmpfs root, "
        f"tiers={{'mem': '/path/to/tmpfs'}} or ${MEM_ROOT_ENV}"
    )


def mem_key(hot: Store, run: str) -> str:
    """Name of the mem tier directory of ``run`` in the hot store ``hot``."""
    ident = f"{hot.backend.url}\0{hot.settings.get('created', '')}"
    return f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}-{run}"


def mem_dir(root: str, hot: Store, run: str) -> str:
    return os.path.join(root, mem_key(hot, run))


def _tree_bytes(path: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return total


def default_budget(root: str) -> int:
    """Half the size of the filesystem holding ``root`` (tmpfs is shared with the job)."""
    probe = root
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    st = os.statvfs(probe)
    return st.f_blocks * st.f_frsize // 2


class MemTier:
    """The mem tier of one hot store and run: its store, budget and evictions.

    ``lock`` is held while a save evicts, writes and commits (and while anything else
    writes into ``store``), so an eviction never removes an object a commit relies on.
    """

    def __init__(self, hot: Store, run: str, root: str, budget: int) -> None:
        self.hot = hot
        self.run = run
        self.root = os.path.abspath(root)
        self.path = mem_dir(self.root, hot, run)
        self.budget = int(budget)
        self.lock = threading.RLock()
        #: called ``(run, step)`` after a mem copy is evicted (a replica may drop it too)
        self.on_evict: list[Callable[[str, int], None]] = []
        defaults = {k: hot.settings[k] for k in _INHERITED if k in hot.settings}
        defaults["codec"] = "raw"
        try:
            os.makedirs(self.path, exist_ok=True)
            self.store = Store.open(LocalBackend(self.path), create=True, defaults=defaults)
        except OSError as exc:
            raise StepvaultError(
                f"cannot create the mem tier in {self.path}: {exc}; give a writable tmpfs "
                f"root with tiers={{'mem': PATH}} or ${MEM_ROOT_ENV}"
            ) from exc

    # -- ownership ---------------------------------------------------------------------
    def claim(self, disk_run: str | None = None) -> None:
        """Record this process as the owner (a restarted job takes over its mem tier) and
        drop what a killed writer left behind: temp files and unreferenced objects.

        ``disk_run``: the run in the hot store whose lease and checkpoints decide when this
        tier is stale (a rank's own tier under a process group holds ``run+rank<r>``,
        whose steps are the collective run's on disk); default: the tier's own run."""
        write_owner(self.path, self.hot, self.run, self.budget, disk_run=disk_run)
        with self.lock:
            sweep(self.store, grace_seconds=0)  # the run's lease is ours: no writer races

    # -- contents ----------------------------------------------------------------------
    def steps(self) -> list[int]:
        return self.store.list_steps(self.run)

    def used_bytes(self) -> int:
        """Every byte under the mem tier's directory (temp files and orphans included)."""
        return _tree_bytes(self.path)

    def usage(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "bytes": self.used_bytes(),
            "checkpoints": len(self.steps()),
            "steps": self.steps(),
            "budget": self.budget,
        }

    # -- budget ------------------------------------------------------------------------
    def evict(self, step: int) -> int:
        """Remove ``run@step`` from mem (manifest first, then the objects only it used);
        the bytes freed."""
        with self.lock:
            before = self.used_bytes()
            self.store.delete_manifest(self.run, step)
            sweep(self.store, grace_seconds=0)
            for hook in self.on_evict:
                hook(self.run, step)
            return max(0, before - self.used_bytes())

    def make_room(
        self, nbytes: int, on_disk: Iterable[int] = (), log: Callable[..., None] | None = None
    ) -> bool:
        """Evict oldest mem copies (those in ``on_disk`` first) until ``nbytes`` more fit
        in the budget; False (nothing evicted) when even an empty mem tier is too small."""
        with self.lock:
            if nbytes + self._fixed_bytes() > self.budget:
                return False
            disk = set(on_disk)
            steps = self.steps()
            order = [s for s in steps if s in disk] + [s for s in steps if s not in disk]
            while self.used_bytes() + nbytes > self.budget and order:
                step = order.pop(0)
                freed = self.evict(step)
                if log is not None:
                    log(
                        "mem_evicted",
                        step=step,
                        reason="memory budget",
                        on_disk=step in disk,
                        freed_bytes=freed,
                    )
            return self.used_bytes() + nbytes <= self.budget

    def _fixed_bytes(self) -> int:
        """What an empty mem tier still holds (settings, owner record, run info)."""
        total = 0
        for key in ("settings.json", OWNER_KEY):
            try:
                total += self.store.backend.size(key)
            except (FileNotFoundError, OSError):
                continue
        return total + 4096

    # -- clean-up ----------------------------------------------------------------------
    def remove(self) -> None:
        """Delete the whole mem tier of this run (its directory)."""
        with self.lock:
            remove_tier_dir(self.path)


def write_owner(
    path: str,
    hot: Store,
    run: str,
    budget: int | None,
    *,
    disk_run: str | None = None,
    kind: str = "own",
) -> None:
    """Write ``owner.json`` into the mem directory ``path``: this process (pid, host) owns
    it for ``run`` of ``hot``; ``kind`` is ``"own"`` (a store of the run's checkpoints) or
    ``"peers"`` (replicas of other nodes' ranks, ``peers/<node>/rank<l>`` stores)."""
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "hot": hot.backend.url,
        "run": run,
        "disk_run": disk_run or run,
        "kind": kind,
        "budget": budget,
        "claimed": time.time(),
    }
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    os.makedirs(path, exist_ok=True)
    LocalBackend(path).put_atomic(OWNER_KEY, [data], overwrite=True)


def open_mem_tier(
    hot: Store, run: str, *, root: str | None = None, budget: int | None = None
) -> MemTier:
    """The mem tier of ``run`` in ``hot`` under ``root`` (default :func:`default_mem_root`)."""
    root = os.path.abspath(root) if root else default_mem_root()
    return MemTier(hot, run, root, default_budget(root) if budget is None else budget)


# -- listing and reclaiming ------------------------------------------------------------
@dataclass
class MemTierInfo:
    """One mem tier directory found under a mem root, and whether it is stale."""

    path: str
    run: str | None
    hot: str | None
    pid: int | None
    host: str | None
    bytes: int
    steps: list[int] = field(default_factory=list)
    stale: bool = False
    reason: str = ""
    budget: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "run": self.run,
            "hot": self.hot,
            "pid": self.pid,
            "host": self.host,
            "bytes": self.bytes,
            "steps": self.steps,
            "stale": self.stale,
            "reason": self.reason,
            "budget": self.budget,
        }


def _staleness(owner: dict[str, Any], steps: list[int]) -> tuple[bool, str]:
    """The reclaim rule (STORAGE.md): a mem tier is stale when its owner process is gone
    (same host, pid dead) and either its hot store is gone, its run finished (no writer
    lease left), or every checkpoint it holds is also on disk. Then nothing a restart
    needs lives only in it."""
    pid, host = owner.get("pid"), owner.get("host")
    if host != socket.gethostname():
        return False, "owned by another host"
    if isinstance(pid, int) and pid_alive(pid):
        return False, f"owner pid {pid} is alive"
    hot_url, run = owner.get("hot"), owner.get("disk_run") or owner.get("run")
    try:
        hot = Store.open(str(hot_url))
    except (StepvaultError, OSError):
        return True, "owner gone; its hot store is gone"
    from ..store.lease_file import lease_key

    if not hot.backend.exists(lease_key(str(run))):
        return True, "owner gone; the run finished (no writer lease)"
    on_disk = set(hot.list_steps(str(run)))
    if all(s in on_disk for s in steps):
        return True, "owner gone; every checkpoint it holds is on disk"
    return False, "owner gone but it holds checkpoints not on disk (a restart needs them)"


def list_mem_tiers(root: str | None = None) -> list[MemTierInfo]:
    """Every mem tier directory under ``root`` (default: the default mem root)."""
    root = os.path.abspath(root) if root else default_mem_root()
    out: list[MemTierInfo] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return out
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(REMOVING) or not os.path.isfile(os.path.join(path, OWNER_KEY)):
            continue  # a tier being deleted is not a tier
        try:
            with open(os.path.join(path, OWNER_KEY), "rb") as fh:
                owner = json.loads(fh.read())
        except (OSError, ValueError):
            owner = {}
        run = owner.get("run")
        steps = _held_steps(path, owner)
        stale, reason = _staleness(owner, steps) if owner else (True, "no owner record")
        out.append(
            MemTierInfo(
                path,
                run,
                owner.get("hot"),
                owner.get("pid"),
                owner.get("host"),
                _tree_bytes(path),
                steps,
                stale,
                reason,
                owner.get("budget"),
            )
        )
    return out


def _held_steps(path: str, owner: dict[str, Any]) -> list[int]:
    """The steps the mem directory ``path`` holds: of its own store, or of every replica
    store under ``peers/<node>/rank<l>`` (a ``"peers"`` directory; step numbers are the
    collective run's). A store that cannot be read counts as holding nothing."""
    if owner.get("kind") == "peers":
        stores = sorted(p for p in glob.glob(os.path.join(path, "peers", "*", "*")))
    else:
        stores = [path]
    steps: set[int] = set()
    for folder in stores:
        try:
            store = Store.open(LocalBackend(folder))
            runs = [owner["run"]] if owner.get("kind") != "peers" else store.list_runs()
            for run in runs:
                steps.update(store.list_steps(run))
        except (StepvaultError, OSError, KeyError):
            continue
    return sorted(steps)


#: A mem tier being deleted is first renamed to a hidden name with this prefix.
REMOVING = ".removing-"


def remove_tier_dir(path: str) -> None:
    """Delete the mem tier directory ``path`` so that no reader ever sees half of it.

    A directory tree is deleted file by file; a process killed halfway (SIGKILL during
    ``close()``) used to leave a tier that still listed checkpoints whose objects were
    gone. The directory is renamed to a hidden tombstone first (one atomic rename on the
    same filesystem), which :func:`list_mem_tiers` never lists, then deleted; tombstones
    of killed deletions are cleared by :func:`reclaim_stale`.
    """
    path = path.rstrip(os.sep)
    parent, name = os.path.split(path)
    tomb = os.path.join(parent, f"{REMOVING}{name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, tomb)
    except FileNotFoundError:
        return
    except OSError:
        tomb = path  # cannot rename here: delete in place (still better than keeping it)
    shutil.rmtree(tomb, ignore_errors=True)


def reclaim_stale(root: str | None = None, *, dry_run: bool = False) -> list[MemTierInfo]:
    """Delete the stale mem tiers under ``root`` (see :func:`_staleness`), and what a
    killed deletion left behind; the tiers removed."""
    gone = [t for t in list_mem_tiers(root) if t.stale]
    if not dry_run:
        for t in gone:
            remove_tier_dir(t.path)
        base = os.path.abspath(root) if root else default_mem_root()
        try:
            leftovers = [n for n in os.listdir(base) if n.startswith(REMOVING)]
        except FileNotFoundError:
            leftovers = []
        for name in leftovers:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return gone


def mem_tiers_of(hot: Store, root: str | None = None) -> list[MemTierInfo]:
    """The mem tiers (one per run) of the hot store ``hot`` under ``root``."""
    prefix = mem_key(hot, "x")[:16] + "-"
    return [t for t in list_mem_tiers(root) if os.path.basename(t.path).startswith(prefix)]
