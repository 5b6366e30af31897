"""The user docs against the real API: every ``CheckpointManager`` keyword, option and
``mgr.`` attribute they name exists, and the README's self-contained examples run.

The manager's constructor changed under the docs once (issue 27: 26 keywords became 16
and ``options=ManagerOptions(...)``) and the docs kept the old names for a while; these
checks make the next such change fail here instead of in a user's first run.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import stepvault
from stepvault.manager.options import (
    GCOptions,
    LeaseOptions,
    ManagerOptions,
    MemOptions,
    StagingOptions,
)

ROOT = Path(__file__).resolve().parent.parent
# The user docs (ARCHITECTURE.md is the developers' map and BENCHMARKS.md is generated).
DOCS = [
    "README.md",
    "STORAGE.md",
    "INTEGRATIONS.md",
    "PLANNING.md",
    "RELIABILITY.md",
    "MIGRATION.md",
    "FORMAT.md",
]
# A call to one of these in a doc must use only keywords it takes.
CALLABLES = {
    "CheckpointManager": stepvault.CheckpointManager,
    "ManagerOptions": ManagerOptions,
    "StagingOptions": StagingOptions,
    "GCOptions": GCOptions,
    "LeaseOptions": LeaseOptions,
    "MemOptions": MemOptions,
}
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_FENCED = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`]+)`")


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def python_blocks(name: str) -> list[str]:
    """The ```python blocks of a doc, in order."""
    return _BLOCK.findall(_text(name))


def _snippets(name: str) -> list[tuple[str, ast.AST]]:
    """Every python block and every inline code span that parses as Python, with where."""
    text = _text(name)
    out: list[tuple[str, ast.AST]] = []
    for i, block in enumerate(python_blocks(name)):
        out.append((f"{name} python block {i}", ast.parse(block)))
    # A code span may wrap across lines but never across paragraphs or fenced blocks.
    spans = (
        m.group(1) for para in _FENCED.sub("", text).split("\n\n") for m in _SPAN.finditer(para)
    )
    for raw in spans:
        span = " ".join(raw.split())
        if "(" not in span and "mgr." not in span:
            continue
        try:
            with warnings.catch_warnings():  # a span such as `a\|b` is prose, not code
                warnings.simplefilter("ignore", SyntaxWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                tree = ast.parse(span)
        except SyntaxError:  # prose such as `Every(steps=|epochs=)`
            continue
        out.append((f"{name}: `{span}`", tree))
    return out


def _calls(tree: ast.AST) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else None
            )
            if name in CALLABLES:
                found.append((name, [k.arg for k in node.keywords if k.arg is not None]))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_keyword_the_docs_pass_is_taken(doc: str) -> None:
    problems = []
    for where, tree in _snippets(doc):
        for name, keywords in _calls(tree):
            params = inspect.signature(CALLABLES[name]).parameters
            problems += [f"{where}: {name}({k}=...)" for k in keywords if k not in params]
    assert not problems, "options the API does not take (see manager/options.py):\n" + "\n".join(
        problems
    )


def test_every_manager_attribute_the_docs_name_exists(tmp_path: Path) -> None:
    mgr = stepvault.CheckpointManager(tmp_path / "ckpts", run="docs")
    try:
        named = {
            (doc, m.group(1)) for doc in DOCS for m in re.finditer(r"\bmgr\.(\w+)", _text(doc))
        }
        missing = sorted(f"{doc}: mgr.{attr}" for doc, attr in named if not hasattr(mgr, attr))
    finally:
        mgr.close()
    assert not missing, "the docs name manager attributes that do not exist:\n" + "\n".join(missing)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STEPVAULT_MEM_ROOT": str(cwd / "shm")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_readme_options_example_runs(tmp_path: Path) -> None:
    block = next(b for b in python_blocks("README.md") if "ManagerOptions(" in b)
    out = _run(
        block + "\nprint(mgr.options.staging.memory, mgr.options.gc.grace_seconds)\nmgr.close()\n",
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["8000000000", "600"]


def test_readme_mem_tier_example_runs(tmp_path: Path) -> None:
    block = next(b for b in python_blocks("README.md") if "MemOptions(" in b)
    # /ssd/ckpts is the example's path; the store goes under the test's directory instead.
    code = block.replace("/ssd/ckpts", str(tmp_path / "ssd")) + (
        "\nimport torch\nmgr.save(1, {'w': torch.arange(4.0)})\nmgr.wait()\n"
        "print(mgr.mem_tier is not None, mgr.latest_step)\nmgr.close()\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1"]


@pytest.mark.slow
def test_readme_quick_start_runs_and_resumes(tmp_path: Path) -> None:
    quick_start = python_blocks("README.md")[0]
    first = _run(quick_start, tmp_path)
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.splitlines()) == 10  # a save every 1000 of 10,000 steps
    again = _run(quick_start, tmp_path)  # resumes at step 10,000: nothing left to do
    assert again.returncode == 0 and again.stdout == "", again.stderr


@pytest.mark.slow
def test_readme_manager_example_runs_keeps_by_val_loss_and_resumes(tmp_path: Path) -> None:
    """Issue 28: the example saved nothing in a short trial (``loss = ...``, an undefined
    ``state``) and recorded only ``loss``, so its ``KeepBest(metric="val_loss")`` never ranked."""
    block = next(b for b in python_blocks("README.md") if 'KeepBest(3, metric="val_loss"' in b)
    report = (
        "\nimport json, stepvault\n"
        "records = stepvault.open('ckpts').checkpoints('exp1')\n"
        "print(json.dumps({r.step: r.metrics for r in records}))\n"
    )
    first = _run(block + report, tmp_path)
    assert first.returncode == 0, first.stderr
    kept = json.loads(first.stdout.splitlines()[-1])
    # a save every 1,000 of 5,000 steps; KeepLast(3) holds the last three at least
    assert {"3000", "4000", "5000"} <= set(kept) <= {"1000", "2000", "3000", "4000", "5000"}
    assert all(set(m) == {"loss", "val_loss"} for m in kept.values()), kept
    again = _run(block + report, tmp_path)  # resumes at step 5,000: nothing left to do
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1]) == kept


# Manager keywords and methods removed in issue 27, and where each went.
REMOVED = {
    "staging_memory": "ManagerOptions(staging=StagingOptions(memory=...))",
    "gc_grace_seconds": "ManagerOptions(gc=GCOptions(grace_seconds=...))",
    "lease_stale_after": "ManagerOptions(lease=LeaseOptions(stale_after=...))",
    "mem_budget": 'tiers={"mem": MemOptions(budget=...)}',
    "mem_cleanup": 'tiers={"mem": MemOptions(cleanup=...)}',
    "mem_hooks": "nothing (replication: MemOptions(replicate=True))",
    "add_restore_source": "nothing (a new source is a planner Source: ARCHITECTURE.md)",
}


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_name_no_removed_manager_option(doc: str) -> None:
    text = _text(doc)
    found = [f"{name} -> {REMOVED[name]}" for name in REMOVED if re.search(rf"\b{name}\b", text)]
    assert not found, f"{doc} still names removed manager options:\n" + "\n".join(found)
