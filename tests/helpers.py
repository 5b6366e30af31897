"""Plain helpers shared by test modules (fixtures are in tests/conftest.py): tiny states,
comparing modules, damaging a stored object, and running ``tests/scripts/train_loop.py`` as
a real training process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import stepvault
from stepvault.errors import StepvaultError

#: A training process that checkpoints into ``--store`` and prints ``STEP n``, ``FRESH`` or
#: ``RESUMED n`` as it goes and ``FINAL <digest of the trained state>`` at the end.
TRAIN_LOOP = Path(__file__).parent / "scripts" / "train_loop.py"


# ------------------------------------------------------------------------ tiny states
def linear(seed: int = 0, in_features: int = 16, out_features: int = 4) -> torch.nn.Linear:
    """A ``Linear`` whose weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features)


def linear_state(seed: int = 0, width: int = 8, step: int | None = None) -> dict:
    """``{"model": a width x width Linear seeded by seed, "step": step}`` (``step``
    defaults to ``seed``, so states of different seeds differ in both)."""
    return {"model": linear(seed, width, width), "step": seed if step is None else step}


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules hold the same state-dict keys with bitwise-equal tensors."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -------------------------------------------------------------------------- the CLI
def cli(root, *args: str, env: dict[str, str] | None = None):
    """``stepvault --root <root> *args`` in this process (typer's runner); its result."""
    from typer.testing import CliRunner

    from stepvault.cli.main import app

    return CliRunner().invoke(app, ["--root", str(root), *args], env=env)


# ------------------------------------------------------------------ damaging a store
def object_path(root, digest: str) -> str:
    """Where a local store at ``root`` keeps the object ``digest``."""
    return os.path.join(root, "objects", digest[:2], digest)


def flip_byte(path, at: int = -1) -> None:
    """Flip the lowest bit of the byte ``at`` (from the end) of the file at ``path``: the
    smallest damage, which any content check must still catch."""
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END)
        b = f.read(1)
        f.seek(at, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


# ------------------------------------------------------------- ranks in new processes
def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (a rendezvous, a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_task(
    tasks: dict[str, Callable[..., None]],
    rank: int,
    world: int,
    port: int,
    task: str,
    root: str,
    out: str,
) -> None:
    """The body of a ``*_workers.run``: join a gloo group on ``port``, run
    ``tasks[f"task_{task}"](rank, world, Path(root), Path(out))`` (a worker module passes
    its ``globals()``) and write ``ok`` or the traceback to ``out/rank<r>.txt``."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        tasks[f"task_{task}"](rank, world, Path(root), Path(out))
        result = "ok"
    except BaseException as exc:  # reported to the parent through a file per rank
        result = f"error {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        (Path(out) / f"rank{rank}.txt").write_text(result)
        dist.destroy_process_group()
    # As dist_workers.run: skip C++ static destructors (a joinable gloo thread can abort
    # the process after the rank reported).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(
    run: Callable[..., None],
    world: int,
    task: str,
    store: Path,
    out: Path,
    *extra: str,
    killed: bool = False,
) -> None:
    """Run ``run(rank, world, port, task, store, out, *extra)`` on ``world`` spawned
    processes (a ``*_workers.run``: it joins a gloo group on ``port`` and writes ``ok`` or
    its traceback to ``out/rank<r>.txt``). Fails with a rank's whole traceback unless every
    rank wrote ``ok``. ``killed``: each rank SIGKILLs itself after reporting (a lost node),
    so the processes must end killed."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.txt"):  # a rank that reports nothing fails, never a stale "ok"
        f.unlink()
    kwargs = {"nprocs": world, "join": True, "start_method": "spawn"}
    args = (world, free_port(), task, str(store), str(out), *extra)
    if killed:
        with pytest.raises(mp.ProcessExitedException):
            mp.start_processes(run, args=args, **kwargs)
    else:
        mp.start_processes(run, args=args, **kwargs)
    for rank in range(world):
        result = (out / f"rank{rank}.txt").read_text()
        if result != "ok":  # the whole traceback of the rank, not a truncated diff
            pytest.fail(f"rank {rank} of {world} ({task}):\n{result}", pytrace=False)


# ------------------------------------------------------------ the CLI in a new process
_RUN_CLI = """
import json, sys
from stepvault.cli.main import main
args, modules = json.loads(sys.argv[1])
sys.argv = ["stepvault", *args]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
sys.stdout.write("\\nMODULES " + json.dumps({m: m in sys.modules for m in modules}))
sys.exit(code)
"""


def cli_in_new_process(
    *args: str,
    code: int = 0,
    modules: tuple[str, ...] = ("torch",),
    env: dict[str, str] | None = None,
) -> tuple[str, str, dict[str, bool]]:
    """Run ``stepvault *args`` in a new interpreter, as users start it; its stdout, its
    stderr and, for each of ``modules``, whether the command had imported it by the end
    (start-up cost: commands that only read JSON must not import torch). Fails unless it
    exits with ``code``."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, json.dumps([list(args), list(modules)])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == code, proc.stderr
    out, _, loaded = proc.stdout.rpartition("\nMODULES ")
    return out, proc.stderr, json.loads(loaded)


# ---------------------------------------------------------------- training processes
def wait_for_checkpoint(
    proc: subprocess.Popen, root, run: str, *, min_step: int, timeout: float, name: str
) -> None:
    """Until ``run`` in the store at ``root`` has a committed checkpoint at ``min_step`` or
    later. Fails, naming ``name``, when ``proc`` ends first (with its stderr, a pipe) or no
    such checkpoint comes within ``timeout`` seconds."""
    assert proc.stderr is not None
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{name} ended before it was killed: {proc.stderr.read()}")
        try:
            steps = stepvault.open(root).steps(run)
        except StepvaultError:  # no store yet: the process has not written its first save
            steps = []
        if steps and steps[-1] >= min_step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} wrote no checkpoint at step >= {min_step} in time")


def run_train_loop(store, *args: str, timeout: float = 120) -> str:
    """Run the training script on ``store`` to completion; its stdout (fails on a non-zero
    exit, with its stderr)."""
    out = subprocess.run(
        [sys.executable, str(TRAIN_LOOP), "--store", str(store), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def start_train_loop(store, *args: str) -> subprocess.Popen:
    """Start the training script on ``store``; stdout and stderr are pipes."""
    return subprocess.Popen(
        [sys.executable, str(TRAIN_LOOP), "--store", str(store), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    """Read ``proc``'s stdout up to the first line starting with ``prefix``; that line.
    Kills ``proc`` and fails with its stderr when no such line comes in time."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"no {prefix!r} from the child; stderr: {proc.stderr.read()}")


def final_digest(stdout: str) -> str:
    """The digest on a training script's ``FINAL <digest>`` line."""
    return next(line.split()[1] for line in stdout.splitlines() if line.startswith("FINAL"))
