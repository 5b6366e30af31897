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
                 timeout: float = 20.0, env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.cluster, self.out, self.launch = cluster, out, launch
        hosts = cluster.hosts
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
                f"--rdzv-id=job{launch}", "--max-restarts=0", "--monitor-interval=0.5",
                str(TESTS / "hosts_job.py"), "--root", root, "--out", str(out),
                "--steps", str(steps), "--disk-every", str(disk_every), "--sleep", str(sleep),
                "--launch", str(launch), "--timeout", str(timeout),
            ]  # fmt: skip
            self.procs.append(host.popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT))
        self.world = len(hosts) * per_host

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
            path = self.out / f"progress-{rank}"
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
        for host in self.cluster.hosts:
            host.kill(wipe=False)


def steps_done(progress: list[str]) -> int:
    """The lowest step every rank has saved (-1 before any)."""
    steps = [int(p) if p.isdigit() else -1 for p in progress]
    return min(steps) if steps else -1


def newest_on_disk(root: str) -> int | None:
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
        if disk_before is not None and step < disk_before:
            outcome.broken.append(f"launch {launch} rank {rank}: restored {step}, older than "
                                  f"{disk_before} on disk")  # fmt: skip


def check_store(outcome: Outcome, root: str) -> None:
    """Every committed checkpoint verifies, deep."""
    import stepvault
    from stepvault.errors import StoreNotFoundError

    try:
        report = stepvault.ops.verify(root, deep=True)
    except StoreNotFoundError:
        outcome.notes.append("no store: nothing was committed")
        return
    if not report.ok:
        outcome.corrupt.append(f"verify: {report}")


def run_scenario(cluster: netns.Cluster, scenario: str, work: Path, *, steps: int = 24,
                 rng: random.Random | None = None, root: str | None = None,
                 per_host: int = 1, max_launches: int = 4, sleep: float = 0.1,
                 job_env: dict[str, str] | None = None) -> Outcome:  # fmt: skip
    """Run ``scenario`` once on ``cluster`` with random timing; see the module doc.

    Scenarios: ``kill_save`` (a host dies while saves and replication run), ``kill_restore``
    (a host dies while the relaunched job restores), ``partition`` (a host's link is down
    for 0.5-4 s mid-training, then heals), ``none`` (no fault: the control)."""
    from hosts_job import reference as replay

    rng = rng or random.Random()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    root = root or str(work / "hot")
    for host in cluster.hosts:  # fresh machines: nothing in memory
        host.kill(wipe=True)
    ref = replay(steps)
    outcome = Outcome(scenario)
    world = len(cluster.hosts) * per_host
    victim = cluster.hosts[rng.randrange(1, len(cluster.hosts)) if len(cluster.hosts) > 1 else 0]
    fault_done = scenario == "none"
    for launch in range(max_launches):
        disk_before = newest_on_disk(root)
        for f in work.glob("progress-*"):
            f.unlink()
        job = Job(cluster, root, work, steps=steps, per_host=per_host, launch=launch,
                  sleep=sleep, env=job_env)  # fmt: skip
        outcome.launches += 1
        ended = False
        if not fault_done and scenario == "kill_save":
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
    check_store(outcome, root)
    return outcome


__all__ = ["Job", "Outcome", "run_scenario"]
