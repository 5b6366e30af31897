"""Prove that a training setup resumes exactly: :func:`check_exact_resume`.

The setup is a function ``make_and_train(ctx)`` that builds everything from scratch (seeds
included), resumes from ``ctx.root`` when it holds a checkpoint, saves with ``ctx.save``
and trains until step ``ctx.steps``, calling ``ctx.step_done(step, batch)`` after every
optimizer step. The check runs it three times:

1. straight: ``steps`` steps in one go, into store A;
2. interrupted: the same, into store B, stopped (an exception, like a crash) at the first
   step after ``interrupt_at``, once the checkpoint of ``interrupt_at`` is written;
3. resumed: a *fresh Python process* that runs ``make_and_train`` again on store B, so it
   resumes from ``interrupt_at`` and trains to ``steps``.

Then it compares, step by step, the batches each run trained on and every checkpoint both
stores hold (weights, optimizer state, RNG, data position, everything stored), byte for
byte, and reports equality or the first step and the first value that differs.

(Longer than most modules: one tool — the straight, interrupted and fresh-process runs
and the comparison that names the first difference.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

PHASES = ("straight", "interrupted", "resumed")


class Interrupted(BaseException):
    """Raised by :meth:`ResumeContext.step_done` to stop the interrupted run (a crash).

    A ``BaseException``, so that a training loop's ``except Exception`` does not swallow it.
    """


@dataclasses.dataclass
class ResumeContext:
    """What ``make_and_train`` gets: where to save, when, and how far to train."""

    root: str  #: the store to save into and resume from
    run: str  #: the run name to use in it
    steps: int  #: train until this global step (the total of the uninterrupted run)
    save_every: int  #: save a full checkpoint every this many steps (``save``)
    phase: str  #: "straight", "interrupted" or "resumed"
    interrupt_at: int  #: the interrupted run stops after this step's checkpoint
    trace: str  #: file of the batch digests this phase records

    @property
    def save(self) -> Any:
        """The save policy to use: ``Every(steps=save_every)``."""
        from ..policy import Every

        return Every(steps=self.save_every)

    def step_done(self, step: int, batch: Any = None) -> None:
        """Call after each optimizer step (``step`` = steps done so far), with the batch it
        trained on when you have it; the interrupted run stops here after its save."""
        if self.phase == "interrupted" and step > self.interrupt_at:
            raise Interrupted(f"interrupted at step {step}")
        if batch is not None:
            with open(self.trace, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": int(step), "batch": batch_digest(batch)}) + "\n")

    def lightning_callback(self) -> Any:
        """A Lightning callback that calls :meth:`step_done` with each batch."""
        try:
            import lightning.pytorch as pl
        except ImportError:  # the standalone package
            import pytorch_lightning as pl  # type: ignore[no-redef]
        ctx = self

        class StepDone(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                ctx.step_done(trainer.global_step, batch)

        return StepDone()

    def transformers_callback(self) -> Any:
        """A ``transformers.TrainerCallback`` that calls :meth:`step_done` (no batches:
        the Trainer does not show them to callbacks)."""
        from transformers import TrainerCallback

        ctx = self

        class StepDone(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                ctx.step_done(state.global_step)

        return StepDone()


def batch_digest(batch: Any) -> str:
    """A digest of every tensor, array and plain value in a (nested) batch."""
    h = hashlib.blake2b(digest_size=12)
    for path, value in _leaves(batch, ""):
        h.update(path.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, np.ndarray):
            h.update(str((value.dtype, value.shape)).encode() + value.tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in value:
            yield from _leaves(value[key], f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


# ----------------------------------------------------------------------------- report
@dataclasses.dataclass
class Difference:
    """The first value that differs at a step."""

    step: int
    what: str  #: "batch", "weights", "optimizer state", "RNG", "LR scheduler", ...
    path: str  #: where in the checkpoint (or "batch")
    detail: str  #: e.g. "max abs difference 0.046" or the two values

    def __str__(self) -> str:
        return f"step {self.step}: {self.what} differs at {self.path} ({self.detail})"


@dataclasses.dataclass
class ResumeReport:
    """The outcome of :func:`check_exact_resume`."""

    steps: int
    interrupt_at: int
    resumed_from: int | None  #: the step the fresh process resumed from
    compared_checkpoints: list[int]
    compared_batches: int
    first_difference: Difference | None
    differences_at_first_step: list[Difference]
    fresh_process: bool = True  #: whether the resumed run had a process of its own

    @property
    def exact(self) -> bool:
        """Every compared batch and checkpoint is bitwise equal."""
        return self.first_difference is None

    def __str__(self) -> str:
        where = "in a fresh process" if self.fresh_process else "in the same process"
        head = (
            f"{self.steps} steps, interrupted after {self.interrupt_at}, resumed from "
            f"{self.resumed_from} {where}; compared {self.compared_batches} batches "
            f"and the checkpoints of steps {self.compared_checkpoints}"
        )
        if self.exact:
            return f"exact resume: {head}: all bitwise equal"
        more = "".join(
            f"\n  also {d.what} at {d.path}" for d in self.differences_at_first_step[1:6]
        )
        return f"NOT an exact resume: {head}\n  first: {self.first_difference}{more}"


def _kind(path: str) -> str:
    low = path.lower()
    for words, kind in (
        (("rng", "random", "generator"), "RNG"),
        (("sched",), "LR scheduler"),
        (("optim",), "optimizer state"),
        (("loader", "loops", "data", "sampler"), "data position"),
        (("model", "state_dict"), "weights"),
    ):
        if any(w in low for w in words):
            return kind
    return "values"


def _compare(a: Any, b: Any, path: str, step: int, out: list[Difference]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            sub = f"{path}[{key!r}]"
            if key not in a or key not in b:
                out.append(Difference(step, _kind(sub), sub, "present in only one run"))
            else:
                _compare(a[key], b[key], sub, step, out)
        return
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{path}[{i}]", step, out)
        return
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            detail = f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        elif torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return
        elif a.is_floating_point():
            diff = (a.double() - b.double()).abs().max().item()
            detail = f"max abs difference {diff:.3g}"
        else:
            detail = f"{int((a != b).sum())} of {a.numel()} elements differ"
        out.append(Difference(step, _kind(path), path, detail))
        return
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes():
            return
        out.append(Difference(step, _kind(path), path, "arrays differ"))
        return
    same = type(a) is type(b) and (
        a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
    )
    if not same:
        out.append(Difference(step, _kind(path), path, f"{a!r} vs {b!r}"))


# -------------------------------------------------------------------------- running
def _target_spec(make_and_train: Callable[[ResumeContext], Any] | str) -> str:
    if isinstance(make_and_train, str):
        return make_and_train
    qualname = getattr(make_and_train, "__qualname__", "")
    module = getattr(make_and_train, "__module__", None)
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"check_exact_resume needs a function a fresh process can import: define "
            f"{qualname or make_and_train!r} at the top level of a module (or pass "
            "'module:function' or 'path/to/file.py:function')"
        )
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise ValueError(
                "make_and_train is defined in an interactive session: put it in a file"
            )
        return f"{os.path.abspath(path)}:{qualname}"
    return f"{module}:{qualname}"


def load_target(spec: str) -> Callable[[ResumeContext], Any]:
    """The function a ``'module:function'`` or ``'file.py:function'`` spec names."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"expected 'module:function' or 'file.py:function', got {spec!r}")
    if where.endswith(".py"):
        modname = "_stepvault_resume_target_" + hashlib.sha1(where.encode()).hexdigest()[:8]
        module = sys.modules.get(modname)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(modname, where)
            if loader_spec is None or loader_spec.loader is None:
                raise ValueError(f"cannot import {where}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[modname] = module
            loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part)
    return target


def run_phase(spec: str, ctx: ResumeContext) -> None:
    """Run one phase in this process (what the fresh process does)."""
    try:
        load_target(spec)(ctx)
    except Interrupted:
        if ctx.phase != "interrupted":
            raise


def _run_fresh(spec: str, ctx: ResumeContext, timeout: float) -> None:
    env = dict(os.environ)
    # The caller's import path, so that the target's module (a test file, a package being
    # developed) imports in the fresh process as it does here.
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    payload = json.dumps({"target": spec, "ctx": dataclasses.asdict(ctx)})
    proc = subprocess.run(
        [sys.executable, "-m", "stepvault.testing", "--phase-json", payload],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"the {ctx.phase} run of {spec} failed in its fresh process (exit "
            f"{proc.returncode}):\n{proc.stderr[-4000:]}"
        )


def _trace(path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                out[rec["step"]] = rec["batch"]
    return out


def check_exact_resume(
    make_and_train: Callable[[ResumeContext], Any] | str,
    *,
    steps: int,
    interrupt_at: int,
    save_every: int = 1,
    run: str = "resume-check",
    workdir: str | os.PathLike[str] | None = None,
    isolate: Literal["resume", "all", "none"] = "resume",
    ignore: Sequence[str] = (),
    timeout: float = 600,
) -> ResumeReport:
    """Run ``make_and_train`` straight, interrupted and resumed; compare bit for bit.

    Parameters:
        make_and_train: ``f(ctx: ResumeContext)``, a module-level function (or its
            ``'module:function'`` / ``'file.py:function'`` name): build the model,
            optimizer, loaders from scratch with fixed seeds, resume from ``ctx.root`` when
            it has a checkpoint, save with ``ctx.save`` (``Every(steps=save_every)``), train
            until ``ctx.steps`` and call ``ctx.step_done(step, batch)`` after every step.
        steps: the total number of steps.
        interrupt_at: the step whose checkpoint the fresh process resumes from (a
            multiple of ``save_every``); pick one mid-epoch, before an epoch boundary.
        save_every: checkpoint interval; every checkpoint both runs write is compared, so
            1 finds the first differing step exactly.
        workdir: where the two stores go (a temporary directory, removed, by default).
        isolate: which runs get a fresh Python process: ``"resume"`` (default: the resumed
            run, which is what must not inherit anything from memory), ``"all"``, or
            ``"none"`` (everything in this process: fast, but not a proof).
        ignore: checkpoint paths containing any of these strings are not compared (a
            trainer's own bookkeeping that is known to differ and does not change training,
            e.g. ``"epoch_progress"`` for Lightning resumed after an epoch's last batch).

    Returns a :class:`ResumeReport`; ``report.exact`` is True when every batch and every
    checkpoint is bitwise equal, else ``report.first_difference`` names the first step and
    the first differing value (batch, weights, optimizer state, RNG, ...).
    """
    if not 0 < interrupt_at < steps:
        raise ValueError(f"interrupt_at must be between 0 and steps={steps}, got {interrupt_at}")
    if interrupt_at % save_every:
        raise ValueError(
            f"interrupt_at={interrupt_at} is not a multiple of save_every={save_every}: the "
            "interrupted run would have no checkpoint there to resume from"
        )
    spec = _target_spec(make_and_train)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="stepvault-resume-check-") as tmp:
            return check_exact_resume(
                spec,
                steps=steps,
                interrupt_at=interrupt_at,
                save_every=save_every,
                run=run,
                workdir=tmp,
                isolate=isolate,
                ignore=ignore,
                timeout=timeout,
            )
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)

    def ctx(phase: str, store: str) -> ResumeContext:
        return ResumeContext(
            root=str(work / store),
            run=run,
            steps=steps,
            save_every=save_every,
            phase=phase,
            interrupt_at=interrupt_at,
            trace=str(work / f"{phase}.trace.jsonl"),
        )

    for phase, store in (
        ("straight", "straight"),
        ("interrupted", "resumed"),
        ("resumed", "resumed"),
    ):
        c = ctx(phase, store)
        if os.path.exists(c.trace):
            os.remove(c.trace)
        fresh = isolate == "all" or (isolate == "resume" and phase == "resumed")
        if fresh:
            _run_fresh(spec, c, timeout)
        else:
            run_phase(spec, c)
        if phase == "interrupted":
            _check_interrupted(c)
    report = compare_runs(work, run, steps=steps, interrupt_at=interrupt_at, ignore=ignore)
    report.fresh_process = isolate != "none"
    return report


def _check_interrupted(c: ResumeContext) -> None:
    from .. import open as open_store

    try:
        steps = open_store(c.root).steps(c.run)
    except Exception:  # no store at all: reported below
        steps = []
    if c.interrupt_at not in steps:
        raise RuntimeError(
            f"the interrupted run wrote no checkpoint at step {c.interrupt_at} "
            f"(committed: {steps}): save with ctx.save into ctx.root under run ctx.run, call "
            "ctx.step_done after every step, and close the manager when training raises (a "
            "with-block or try/finally; the integrations do it themselves)"
        )


def compare_runs(
    workdir: str | os.PathLike[str],
    run: str,
    *,
    steps: int,
    interrupt_at: int,
    ignore: Sequence[str] = (),
) -> ResumeReport:
    """Compare the straight and the interrupted+resumed runs of a check in ``workdir``."""
    from .. import open as open_store

    work = Path(workdir)
    straight_trace = _trace(str(work / "straight.trace.jsonl"))
    resumed_trace = {
        **{
            s: d
            for s, d in _trace(str(work / "interrupted.trace.jsonl")).items()
            if s <= interrupt_at
        },
        **_trace(str(work / "resumed.trace.jsonl")),
    }
    diffs: list[Difference] = []
    batch_steps = sorted(set(straight_trace) & set(resumed_trace))
    for s in batch_steps:
        if straight_trace[s] != resumed_trace[s]:
            diffs.append(Difference(s, "batch", "batch", "the runs trained on different data"))
            break
    for s in sorted(set(straight_trace) ^ set(resumed_trace)):
        if s <= steps:
            diffs.append(Difference(s, "batch", "batch", "only one run trained a step here"))
            break
    a, b = open_store(work / "straight"), open_store(work / "resumed")
    common = sorted(set(a.steps(run)) & set(b.steps(run)))
    resumed_from = interrupt_at if interrupt_at in b.steps(run) else None
    first_ckpt: list[Difference] = []
    for s in common:
        found: list[Difference] = []
        _compare(a.checkpoint(run, s).load(), b.checkpoint(run, s).load(), "state", s, found)
        found = [d for d in found if not any(pattern in d.path for pattern in ignore)]
        if found:
            first_ckpt = found
            break
    if first_ckpt:
        diffs.extend(first_ckpt)
    if not diffs:
        return ResumeReport(steps, interrupt_at, resumed_from, common, len(batch_steps), None, [])
    first_step = min(d.step for d in diffs)
    at_first = [d for d in diffs if d.step == first_step]
    return ResumeReport(
        steps, interrupt_at, resumed_from, common, len(batch_steps), at_first[0], at_first
    )


def assert_exact_resume(
    make_and_train: Callable[[ResumeContext], Any] | str, **kwargs: Any
) -> ResumeReport:
    """:func:`check_exact_resume` for tests: raises ``AssertionError`` with the report
    unless the resume is exact (use it in a pytest test)."""
    report = check_exact_resume(make_and_train, **kwargs)
    if not report.exact:
        raise AssertionError(str(report))
    return report
