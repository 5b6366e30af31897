"""Fault scenarios across namespaced hosts (``tests/netns.py``), shared by the tests
(``tests/test_hosts.py``) and the campaign (``scripts/campaign_hosts.py``).

A :class:`Job` runs ``tests/hosts_job.py`` under ``torchrun`` on every host of a
:class:`~netns.Cluster` with c10d rendezvous on ``h0`` (one torchrun per host, its ranks
in that host's namespaces; gloo over the hosts' ``eth0``). A scenario trains, injects one
fault at a random moment, relaunches the whole job (as a scheduler would) until it ends,
and checks the outcome (:class:`Outcome`):

* every launch's restore is bitwise the uninterrupted reference at its step, never older
  than the newest checkpoint on disk when it started, and every rank restored the same
  step;
* the job ends with the reference's final state on every rank;
* every committed checkpoint in the store verifies (``stepvault.ops.verify``, deep):
  nothing half-written is visible.

A broken resume (a restore or final state that differs from the reference, ranks that
disagree, a restore older than disk) and an undetected corruption (a committed checkpoint
that does not verify) are counted separately.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import netns

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@dataclass
class Outcome:
    """What one scenario run found."""

    scenario: str
    launches: int = 0
    restored: list[tuple[int, str | None]] = field(default_factory=list)  # (step, tier)
    broken: list[str] = field(default_factory=list)  # broken resumes, each explained
    corrupt: list[str] = field(default_factory=list)  # committed but not verifying
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.broken and not self.corrupt


class Job:
    """One launch of ``hosts_job.py`` on every host of ``cluster``."""

    def __init__(self, cluster: netns.Cluster, root: str, out: Path, *, steps: int,
                 per_host: int = 1, disk_every: int = 3, sleep: float = 0.1, launch: int = 0,
                 timeout: float = 20.0, env: dict[str, str] | None = None,
                 width: int = 0, hosts: list[netns.Host] | None = None,
                 stale_after: float | None = None) -> None:  # fmt: skip
        self.cluster, self.out, self.launch = cluster, out, launch
        # ``hosts``: the job's own allocation (default: every host of the cluster)
        self.hosts = hosts = list(hosts or cluster.hosts)
        endpoint = f"{hosts[0].address}:29400"
        self.procs: list[subprocess.Popen[bytes]] = []
        environ = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        environ.pop("STEPVAULT_NODE", None)  # torchrun's GROUP_RANK names the node
        for host in hosts:
            log = open(out / f"log-{launch}-{host.name}.txt", "wb")  # noqa: SIM115
            argv = [
                TORCHRUN, f"--nnodes={len(hosts)}", f"--nproc-per-node={per_host}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id=job{launch}", "--max-restarts=0", "--monitor-interval=0.1",
                str(TESTS / "hosts_job.py"), "--root", root, "--out", str(out),
                "--steps", str(steps), "--disk-every", str(disk_every), "--sleep", str(sleep),
                "--launch", str(launch), "--timeout", str(timeout), "--width", str(width),
                *(["--stale-after", str(stale_after)] if stale_after else []),
            ]  # fmt: skip
            self.procs.append(host.popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT))
        self.world = len(hosts) * per_host

    def ended(self, timeout: float) -> bool:
        """Whether every host's torchrun ended (any exit code) within ``timeout`` s."""
        self.wait(timeout)
        return all(p.poll() is not None for p in self.procs)

    def errors(self) -> dict[int, dict]:
        """The error each failed rank wrote (``error-<launch>-<rank>.json``), by rank."""
        out = {}
        for rank in range(self.world):
            path = self.out / f"error-{self.launch}-{rank}.json"
            if path.exists():
                out[rank] = json.loads(path.read_text())
        return out

    def wait(self, timeout: float) -> bool:
        """Whether every host's torchrun ended with 0 within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return all(p.returncode == 0 for p in self.procs)

    def progress(self) -> list[str]:
        """Every rank's progress: "starting", "restoring" or the last step saved."""
        out = []
        for rank in range(self.world):
            path = self.out / f"progress-{self.launch}-{rank}"
            out.append(path.read_text() if path.exists() else "")
        return out

    def wait_for(self, predicate, timeout: float) -> bool:
        """Poll the ranks' progress until ``predicate(progress)`` or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.progress()):
                return True
            if all(p.poll() is not None for p in self.procs):
                return predicate(self.progress())
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """End this launch everywhere (the scheduler kills what is left of the job); the
        hosts' memory stays."""
        for host in self.hosts:
            host.kill(wipe=False)


class S3Host:
    """moto's S3 server on the cluster's ``s3`` host, behind :class:`~netns.FaultyTCP`
    (latency, resets) on the same host; :meth:`conditions` sets the faults and a ``tc tbf``
    cap on what the S3 host sends. Jobs reach it at :attr:`endpoint` (the proxy)."""

    PORT, PROXY_PORT = 5000, 5001

    def __init__(self, cluster: netns.Cluster) -> None:
        assert cluster.s3 is not None, "make the cluster with s3=True"
        self.cluster, self.host = cluster, cluster.s3
        self.endpoint = f"http://{self.host.address}:{self.PROXY_PORT}"
        code = (
            "import logging, os, time\n"
            "from moto.server import ThreadedMotoServer\n"
            "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
            f"s = ThreadedMotoServer(ip_address='0.0.0.0', port={self.PORT}, verbose=False)\n"
            "s.start()\n"
            "import boto3\n"
            f"boto3.client('s3', endpoint_url='http://127.0.0.1:{self.PORT}', "
            "region_name='us-east-1').create_bucket(Bucket='ckpt')\n"
            "print('ready', flush=True)\n"
            "time.sleep(1e9)\n"
        )
        env = {**os.environ, **S3_ENV}
        self.server = self.host.popen([sys.executable, "-c", code], env=env,
                                      stdout=subprocess.PIPE)  # fmt: skip
        assert self.server.stdout is not None
        if self.server.stdout.readline().strip() != b"ready":
            raise RuntimeError("moto did not start on the s3 host")
        self.proxy: subprocess.Popen[bytes] | None = None
        self.conditions()

    def conditions(self, *, delay: float = 0.0, reset: float = 0.0, rate: str | None = None,
                   seed: int = 0) -> None:  # fmt: skip
        """Restart the proxy with ``delay`` (mean seconds per forwarded read) and ``reset``
        (fraction of connections cut), and cap the host's sending rate (None: no cap)."""
        if self.proxy is not None:
            self.proxy.kill()
            self.proxy.wait()
        argv = [sys.executable, str(TESTS / "netns.py"), "proxy", str(self.PROXY_PORT),
                f"127.0.0.1:{self.PORT}", "--delay", str(delay), "--reset", str(reset),
                "--seed", str(seed)]  # fmt: skip
        self.proxy = self.host.popen(argv, stdout=subprocess.PIPE)
        assert self.proxy.stdout is not None
        if self.proxy.stdout.readline().strip() != b"ready":
            raise RuntimeError("the fault proxy did not start on the s3 host")
        if rate is None:
            self.host.uncap()
        else:
            self.host.cap(rate=rate)

    def env(self) -> dict[str, str]:
        """What a job needs to reach the store through the proxy."""
        return {**S3_ENV, "AWS_ENDPOINT_URL": self.endpoint}

    def stop(self) -> None:
        for proc in (self.proxy, self.server):
            if proc is not None:
                proc.kill()
                proc.wait()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def in_host(host: netns.Host, code: str, env: dict[str, str] | None = None) -> object:
    """Run ``code`` (which prints one JSON value) in ``host``: stores on the S3 host are
    reachable from the hosts only."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
               **(env or {})}  # fmt: skip
    got = subprocess.run(host.argv([sys.executable, "-c", code]), env=environ,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    if got.returncode != 0:
        raise RuntimeError(f"in {host.name}: {got.stderr[-2000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def steps_done(progress: list[str]) -> int:
    """The lowest step every rank has saved (-1 before any)."""
    steps = [int(p) if p.isdigit() else -1 for p in progress]
    return min(steps) if steps else -1


def newest_on_disk(root: str, via: tuple[netns.Host, dict[str, str]] | None = None) -> int | None:
    """The newest step committed in the hot store (``via``: read from that host)."""
    if via is not None:
        code = (
            "import json\nfrom stepvault.store import Store\n"
            f"try: s = Store.open({root!r}).list_steps('r')\nexcept Exception: s = []\n"
            "print(json.dumps(max(s, default=None)))"
        )
        return in_host(via[0], code, via[1])  # type: ignore[return-value]
    from stepvault.store import Store

    try:
        steps = Store.open(root).list_steps("r")
    except Exception:
        return None
    return max(steps, default=None)


def check_launch(outcome: Outcome, out: Path, launch: int, world: int, reference: list[str],
                 disk_before: int | None) -> None:  # fmt: skip
    """Check the restores of one launch (those that got that far)."""
    docs = []
    for rank in range(world):
        path = out / f"restore-{launch}-{rank}.json"
        if path.exists():
            docs.append(json.loads(path.read_text()))
    if not docs:
        return
    steps = {d["step"] for d in docs}
    if len(docs) == world and len(steps) != 1:
        outcome.broken.append(f"launch {launch}: ranks restored different steps {sorted(steps)}")
    for rank, doc in enumerate(docs):
        step = doc["step"]
        outcome.restored.append((step, doc["tier"]))
        if doc["digest"] != reference[step]:
            outcome.broken.append(f"launch {launch} rank {rank}: step {step} ({doc['tier']}) "
                                  "differs from the reference")  # fmt: skip
        if step > 0 and doc.get("saved_by") is None:  # the save's metadata came back
            outcome.broken.append(f"launch {launch} rank {rank}: step {step} ({doc['tier']}) "
                                  "restored without the metadata it was saved with")  # fmt: skip
        if disk_before is not None and step < disk_before:
            outcome.broken.append(f"launch {launch} rank {rank}: restored {step}, older than "
                                  f"{disk_before} on disk")  # fmt: skip


def check_store(
    outcome: Outcome, root: str, via: tuple[netns.Host, dict[str, str]] | None = None
) -> None:
    """Every committed checkpoint verifies, deep (``via``: checked from that host)."""
    if via is not None:
        code = (
            "import json, stepvault\n"
            f"r = stepvault.ops.verify({root!r}, deep=True)\n"
            "print(json.dumps([r.ok, str(r)]))"
        )
        ok, text = in_host(via[0], code, via[1])  # type: ignore[misc]
        if not ok:
            outcome.corrupt.append(f"verify: {text}")
        return
    import stepvault
    from stepvault.errors import StoreNotFoundError

    try:
        report = stepvault.ops.verify(root, deep=True)
    except StoreNotFoundError:
        outcome.notes.append("no store: nothing was committed")
        return
    if not report.ok:
        outcome.corrupt.append(f"verify: {report}")


def late_commits(root: str, via: tuple[netns.Host, dict[str, str]] | None = None) -> list[int]:
    """Steps whose manifest landed after a takeover (the fence rule, FORMAT.md §8): still
    in the store and ignored by every reader, or removed by the owner (its
    ``stale_commit_removed`` events). A trial that saw one shows that the rule held there."""
    if via is not None:
        code = (
            "import json\nfrom hosts import late_commits\n"
            f"print(json.dumps(late_commits({root!r})))"
        )
        return [int(s) for s in in_host(via[0], code, via[1])]  # type: ignore[attr-defined]
    from stepvault.catalog.events import read_events
    from stepvault.store import Store

    store = Store.open(root)
    steps = set(store.stale_commits("r"))
    steps |= {
        int(e["step"]) for e in read_events(store, "r") if e.get("event") == "stale_commit_removed"
    }
    return sorted(steps)


def committed_by(
    root: str, via: tuple[netns.Host, dict[str, str]] | None = None
) -> dict[int, object]:
    """Which launch committed each checkpoint of the hot store (the ``launch`` of its
    metadata; ``hosts_job.py`` saves it with every step; ``via``: read from that host)."""
    if via is not None:
        code = (
            "import json\nfrom hosts import committed_by\n"
            f"print(json.dumps(committed_by({root!r})))"
        )
        got = in_host(via[0], code, via[1])
        return {int(k): v for k, v in got.items()}  # type: ignore[attr-defined]
    from stepvault.format import decode_value, parse_manifest
    from stepvault.store import Store

    store = Store.open(root)
    out: dict[int, object] = {}
    for step in store.list_steps("r"):
        m = parse_manifest(store.read_manifest("r", step), f"r@{step}")
        meta = decode_value(m.metadata, lambda kind, name: None)
        out[step] = meta.get("launch") if isinstance(meta, dict) else None
    return out


def _rank_hosts(out: Path, launch: int, world: int, timeout: float = 120) -> dict[int, str]:
    """The host each rank of ``launch`` runs on (``host-<launch>-<rank>``), once known."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [out / f"host-{launch}-{r}" for r in range(world)]
        if all(f.exists() and f.read_text() for f in files):
            return {r: f.read_text() for r, f in enumerate(files)}
        time.sleep(0.05)
    return {}


def _restored(out: Path, launch: int, rank: int, timeout: float) -> dict | None:
    path = out / f"restore-{launch}-{rank}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            with contextlib.suppress(ValueError):
                return json.loads(path.read_text())
        time.sleep(0.05)
    return None


def _finish(
    outcome: Outcome,
    cluster: netns.Cluster,
    root: str,
    work: Path,
    steps: int,
    ref: list[str],
    launch: int,
    hosts: list[netns.Host] | None = None,
    via: tuple[netns.Host, dict[str, str]] | None = None,
) -> None:
    """Relaunch the job (``launch``) on ``hosts``: it must restore the newest checkpoint
    bitwise and end at the reference (``via``: the store is reached from that host)."""
    disk_before = newest_on_disk(root, via)
    job = Job(cluster, root, work, steps=steps, launch=launch, hosts=hosts,
              env=via[1] if via else None)  # fmt: skip
    outcome.launches += 1
    ended = job.wait(timeout=240)
    job.stop()
    check_launch(outcome, work, launch, job.world, ref, disk_before)
    finals = [work / f"final-{launch}-{r}.json" for r in range(job.world)]
    if not ended or not all(f.exists() for f in finals):
        outcome.broken.append(f"launch {launch}: the relaunched job did not finish")
        return
    for rank, f in enumerate(finals):
        if json.loads(f.read_text())["digest"] != ref[steps]:
            outcome.broken.append(f"launch {launch} rank {rank}: final state differs")


def run_stale_writer(cluster: netns.Cluster, work: Path, *, steps: int = 12,
                     rng: random.Random | None = None, sleep: float = 0.1,
                     stale_after: float = 3.0, s3: S3Host | None = None) -> Outcome:  # fmt: skip
    """A stale writer's commit refused across hosts (the fenced commit).

    With ``s3`` the store is on the S3 host and the coordinator's host is *partitioned*
    (``ip link set eth0 down``: it reaches neither the store nor its peers, so its lease
    renewals fail) instead of frozen, then healed: the S3 fence (a conditional renewal
    right before the manifest PUT) must refuse it.

    Job A trains on the first half of the hosts with a short lease (``stale_after``). At a
    random moment (mid-save) the host of A's rank 0, the coordinator that holds the run's
    lease and commits, is frozen (SIGSTOP of all its processes: a stopped VM) past
    ``stale_after``; A's other ranks wait in a collective. A scheduler starts job B on the
    other hosts: it takes the stale lease over, restores the newest checkpoint on disk and
    commits. Once B has committed, A's host is thawed: A's next commit must be refused
    (``LeaseLostError``), every process of A must end (none hangs), no checkpoint A saved
    after B's takeover may be visible, B must end bitwise at the reference, the store must
    verify, and a relaunch on A's hosts must resume the newest checkpoint bitwise."""
    from hosts_job import reference as replay

    rng = rng or random.Random()
    if len(cluster.hosts) < 4:
        raise ValueError("the stale_writer scenario needs 4 hosts (two jobs of 2 hosts)")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    root = str(work / "hot")
    for host in cluster.hosts:
        host.kill(wipe=True)
    half = len(cluster.hosts) // 2
    a_hosts, b_hosts = cluster.hosts[:half], cluster.hosts[half : 2 * half]
    via, env = None, None
    if s3 is not None:
        root = f"s3://ckpt/{work.name}-{rng.randrange(1 << 30):x}"
        s3.conditions()  # no faults but the partition
        env = s3.env()
        via = (b_hosts[0], env)
    ref = replay(steps)
    outcome = Outcome("stale_partition" if s3 else "stale_writer")
    # A's collectives wait out the freeze (the peers of a stopped host block, they do
    # not time out): the gloo timeout is longer than the whole scenario.
    a = Job(cluster, root, work, steps=steps, launch=0, sleep=sleep, hosts=a_hosts,
            stale_after=stale_after, timeout=300, env=env)  # fmt: skip
    outcome.launches += 1
    at = rng.randint(3, steps - 6)
    where = _rank_hosts(work, 0, a.world)
    frozen = next((h for h in a_hosts if h.name == where.get(0)), None)
    if frozen is None or not a.wait_for(lambda p: steps_done(p) >= at, 180):
        a.stop()
        outcome.broken.append(f"job A did not reach step {at}: {a.progress()}")
        return outcome
    time.sleep(rng.uniform(0, 2 * sleep))  # mid-save
    if s3 is None:
        frozen.freeze()
        outcome.notes.append(f"froze {frozen.name} (rank 0 of A) after step {at}")
    else:
        frozen.partition()
        outcome.notes.append(f"partitioned {frozen.name} (rank 0 of A) after step {at}")
    try:
        time.sleep(stale_after + 0.5)  # A's lease is stale from here on
        disk_before = newest_on_disk(root, via)
        b = Job(cluster, root, work, steps=steps, launch=1, sleep=sleep, hosts=b_hosts,
                env=env)  # fmt: skip
        outcome.launches += 1
        got = _restored(work, 1, 0, 60)
        if got is not None:
            # B has committed to disk after its takeover: a step past its restore that is
            # due on disk (every 3rd) plus one, so that commit is done.
            target = min(steps, got["step"] + 4)
            if not b.wait_for(lambda p: steps_done(p) >= target, 180):
                outcome.notes.append(f"B did not reach step {target} while A was frozen")
        else:  # A froze inside its commit, holding the lease's lock: B waits for it
            outcome.notes.append("B waited for the lease lock held by A's frozen host")
    finally:
        if s3 is None:
            frozen.thaw()
        else:
            frozen.heal()
    got = got or _restored(work, 1, 0, 120)
    if got is None:
        a.stop()
        b.stop()
        outcome.broken.append(f"job B did not take the run over: {b.errors()}")
        return outcome
    if not a.ended(90):
        outcome.broken.append("job A hangs after its coordinator's host was thawed")
    a.stop()
    errors = a.errors()
    lost = errors.get(0, {})
    late = late_commits(root, via)
    # A stale writer ends refused (LeaseLostError) or, when the partition cut its upload
    # before it reached the fence, with the failed save (SaveFailedError: nothing of that
    # step committed); then none of A's manifests may have landed late (campaign trial 20).
    failed_first = (
        lost.get("type") == "SaveFailedError"
        and "Nothing of step" in str(lost.get("message"))
        and not late
    )
    if lost.get("type") != "LeaseLostError" and not failed_first:
        outcome.broken.append(
            f"A's rank 0 was not refused with LeaseLostError (nor a save failed before the "
            f"fence with nothing committed): {errors}; late manifests {late}"
        )
    outcome.notes.append(
        "A ended: " + "; ".join(f"rank {r} {e['type']}" for r, e in sorted(errors.items()))
    )
    ended = b.wait(timeout=240)
    b.stop()
    check_launch(outcome, work, 0, a.world, ref, None)
    check_launch(outcome, work, 1, b.world, ref, disk_before)
    finals = [work / f"final-1-{r}.json" for r in range(b.world)]
    if not ended or not all(f.exists() for f in finals):
        outcome.broken.append(f"job B did not finish: {b.errors()}")
    else:
        for rank, f in enumerate(finals):
            if json.loads(f.read_text())["digest"] != ref[steps]:
                outcome.broken.append(f"job B rank {rank}: final state differs")
    # Nothing A saved after the takeover is visible: every checkpoint past the step B
    # resumed from is B's.
    for step, launch in sorted(committed_by(root, via).items()):
        if step > got["step"] and launch != 1:
            outcome.broken.append(f"step {step} committed by launch {launch} after the takeover")
    if late:  # A's commit reached the store after B's takeover: the fence rule held here
        outcome.notes.append(f"A's late manifests ignored and removed: steps {late}")
    check_store(outcome, root, via)
    _finish(outcome, cluster, root, work, steps, ref, 2, hosts=a_hosts, via=via)
    return outcome


def run_disk_full(cluster: netns.Cluster, work: Path, *, steps: int = 12,
                  rng: random.Random | None = None, sleep: float = 0.1) -> Outcome:  # fmt: skip
    """One host's disk fills up during a save.

    What a host writes on its own disk is its node memory: the mem tier and the buddy's
    replicas in its ``/dev/shm`` tmpfs (the hot store is shared by every host). At a random
    moment (mid-save) one host's tmpfs is filled to the last byte. The job must stop with a
    ``StepvaultError`` on every rank (the rank on the full host naming the full disk, the
    others naming that rank's failure), no rank may hang, every committed checkpoint must
    verify; once the disk is freed, the relaunch resumes the newest checkpoint every rank
    can verify, bitwise, and ends at the reference."""
    from hosts_job import reference as replay

    rng = rng or random.Random()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    root = str(work / "hot")
    for host in cluster.hosts:
        host.kill(wipe=True)
    ref = replay(steps)
    outcome = Outcome("disk_full")
    victim = cluster.hosts[rng.randrange(len(cluster.hosts))]
    # The host's disk is nearly full already (a few MiB left: far more than the job's
    # memory copies need), so that filling the rest is quick enough to hit a save.
    victim.fill_shm(leave=16 << 20)
    job = Job(cluster, root, work, steps=steps, launch=0, sleep=sleep, timeout=120)
    outcome.launches += 1
    at = rng.randint(2, steps - 5)
    if not job.wait_for(lambda p: steps_done(p) >= at, 180):
        job.stop()
        outcome.broken.append(f"the job did not reach step {at}: {job.progress()}")
        return outcome
    time.sleep(rng.uniform(0, 2 * sleep))  # mid-save
    filled = victim.fill_shm()
    outcome.notes.append(f"filled {victim.name}'s /dev/shm ({filled >> 20} MiB) after {at}")
    if not job.ended(120):
        outcome.broken.append("a rank hangs after a host's disk filled up")
    job.stop()
    errors = job.errors()
    where = _rank_hosts(work, 0, job.world, timeout=1)
    failed = [r for r, host in where.items() if host == victim.name]
    finals = [work / f"final-0-{r}.json" for r in range(job.world)]
    if all(f.exists() for f in finals):
        # The fill came after the last memory-only save: the job finished (its later
        # saves went to disk).
        outcome.notes.append("the job finished before a memory-only save hit the full disk")
    else:
        # Every rank says why: the one whose save failed names the full disk, the others
        # name that rank's failure (from the run's event log), not a bare gloo error.
        full = [r for r in failed if "no space left" in errors.get(r, {}).get("message", "")]
        if not full:
            outcome.broken.append(f"no full-disk error on {victim.name}'s ranks: {errors}")
        for rank in range(job.world):
            error = errors.get(rank, {})
            if error.get("type") != "StepvaultError":
                outcome.broken.append(f"rank {rank} ended without a clear error: {error}")
    outcome.notes.append(
        "errors: " + "; ".join(f"rank {r} {e['type']}" for r, e in sorted(errors.items()))
    )
    check_launch(outcome, work, 0, job.world, ref, None)
    check_store(outcome, root)
    victim.free_shm()  # the operator frees the disk, the scheduler relaunches
    _finish(outcome, cluster, root, work, steps, ref, 1)
    return outcome


def run_scenario(cluster: netns.Cluster, scenario: str, work: Path, *, steps: int = 24,
                 rng: random.Random | None = None, root: str | None = None,
                 per_host: int = 1, max_launches: int = 4, sleep: float = 0.1,
                 job_env: dict[str, str] | None = None,
                 s3: S3Host | None = None) -> Outcome:  # fmt: skip
    """Run ``scenario`` once on ``cluster`` with random timing; see the module doc.

    Scenarios: ``kill_save`` (a host dies while saves and replication run), ``kill_restore``
    (a host dies while the relaunched job restores), ``partition`` (a host's link is down
    for 0.5-4 s mid-training, then heals), ``s3_slow`` (the hot store on the S3 host
    behind a proxy adding latency and connection resets and a ``tbf`` bandwidth cap, and a
    host killed mid-run; needs ``s3``), ``stale_writer`` (:func:`run_stale_writer`, 4
    hosts), ``stale_partition`` (the same with the store on the S3 host and a partition
    instead of a freeze; needs ``s3``), ``disk_full`` (:func:`run_disk_full`), ``none``
    (no fault: the control)."""
    from hosts_job import reference as replay

    if scenario in ("stale_writer", "stale_partition"):
        if scenario == "stale_partition" and s3 is None:
            raise ValueError("stale_partition needs an S3Host (a cluster with s3=True)")
        return run_stale_writer(cluster, work, steps=steps, rng=rng, sleep=sleep,
                                s3=s3 if scenario == "stale_partition" else None)  # fmt: skip
    if scenario == "disk_full":
        return run_disk_full(cluster, work, steps=steps, rng=rng, sleep=sleep)
    rng = rng or random.Random()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    via = None
    if scenario == "s3_slow":
        if s3 is None:
            raise ValueError("the s3_slow scenario needs an S3Host (a cluster with s3=True)")
        root = f"s3://ckpt/{work.name}-{rng.randrange(1 << 30):x}"
        s3.conditions(
            delay=rng.uniform(0.0, 0.01),
            reset=rng.uniform(0.0, 0.05),
            rate=f"{rng.choice([20, 50, 100])}mbit",
            seed=rng.randrange(1 << 30),
        )
        job_env = {**(job_env or {}), **s3.env()}
        via = (cluster.hosts[0], s3.env())
    root = root or str(work / "hot")
    for host in cluster.hosts:  # fresh machines: nothing in memory
        host.kill(wipe=True)
    ref = replay(steps)
    outcome = Outcome(scenario)
    world = len(cluster.hosts) * per_host
    victim = cluster.hosts[rng.randrange(1, len(cluster.hosts)) if len(cluster.hosts) > 1 else 0]
    fault_done = scenario == "none"
    for launch in range(max_launches):
        disk_before = newest_on_disk(root, via)
        job = Job(cluster, root, work, steps=steps, per_host=per_host, launch=launch,
                  sleep=sleep, env=job_env)  # fmt: skip
        outcome.launches += 1
        ended = False
        if not fault_done and scenario in ("kill_save", "s3_slow"):
            at = rng.randint(2, steps - 4)
            if job.wait_for(lambda p, at=at: steps_done(p) >= at, 180):
                time.sleep(rng.uniform(0, 2 * sleep))  # mid-save, mid-replication
                victim.kill(wipe=True)
                outcome.notes.append(f"killed {victim.name} after step {at}")
            fault_done = True
        elif not fault_done and scenario == "kill_restore" and launch == 1:
            if job.wait_for(lambda p: "restoring" in p or steps_done(p) >= 0, 180):
                time.sleep(rng.uniform(0, 1.0))
                victim.kill(wipe=True)
                outcome.notes.append(f"killed {victim.name} during the restore")
            fault_done = True
        elif not fault_done and scenario == "kill_restore" and launch == 0:
            at = rng.randint(2, steps - 4)
            if job.wait_for(lambda p, at=at: steps_done(p) >= at, 180):
                job.stop()  # the whole job is preempted; the next launch restores
                outcome.notes.append(f"preempted after step {at}")
        elif not fault_done and scenario == "partition":
            at = rng.randint(2, steps - 4)
            if job.wait_for(lambda p, at=at: steps_done(p) >= at, 180):
                time.sleep(rng.uniform(0, 2 * sleep))
                down = rng.uniform(0.5, 4.0)
                victim.partition()
                time.sleep(down)
                victim.heal()
                outcome.notes.append(f"partitioned {victim.name} for {down:.1f} s after {at}")
            fault_done = True
        ended = job.wait(timeout=240)
        job.stop()
        check_launch(outcome, work, launch, world, ref, disk_before)
        finals = [work / f"final-{launch}-{r}.json" for r in range(world)]
        if ended and all(f.exists() for f in finals):
            for rank, f in enumerate(finals):
                if json.loads(f.read_text())["digest"] != ref[steps]:
                    outcome.broken.append(f"launch {launch} rank {rank}: final state differs")
            break
    else:
        outcome.broken.append(f"the job did not finish in {max_launches} launches")
    check_store(outcome, root, via)
    return outcome


__all__ = ["Job", "Outcome", "S3Host", "run_disk_full", "run_scenario", "run_stale_writer"]
