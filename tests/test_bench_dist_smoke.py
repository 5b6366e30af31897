"""Smoke test of benchmarks/bench_dist.py: a tiny run on 1, 2 and 4 gloo ranks writes it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_dist.py"


@pytest.mark.slow
def test_bench_dist_writes_section(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    before = "# Benchmarks\n\nkept before\n\n<!-- core:begin -->\ncore stays\n<!-- core:end -->\n"
    out.write_text(before)
    work = tmp_path / "work"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--size-mb",
            "4",
            "--repeats",
            "1",
            "--load-repeats",
            "1",
            "--no-profile",  # a smoke run: py-spy of a (noisy) miss is not what it checks
            "--out",
            str(out),
            "--workdir",
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    # The markers were appended at the end; everything before them is untouched.
    assert text.startswith(before.rstrip("\n"))
    assert text.count("<!-- dist:begin -->") == 1 and text.count("<!-- dist:end -->") == 1
    assert text.rstrip().endswith("<!-- dist:end -->")
    section = text.split("<!-- dist:begin -->")[1].split("<!-- dist:end -->")[0]
    for heading in ("### Machine", "### Summary", "### Method"):
        assert heading in section
    for world in (1, 2, 4):
        assert f"### World size {world} " in section
    for metric in (
        "stepvault / DCP save throughput",
        "stepvault / DCP load throughput",
        "second unchanged stepvault save: new bytes / first",
        "loaded state bitwise equal",
    ):
        assert section.count(f"| {metric}") == 3, metric
    verdicts = [
        line.rsplit("|", 2)[1].strip()
        for line in section.splitlines()
        if line.startswith("| stepvault / DCP ") or line.startswith("| loaded state")
    ]
    assert len(verdicts) == 9 and set(verdicts) <= {"PASS", "MISS"}
    assert "stepvault yes, DCP yes" in section  # bitwise equal on every world size
    assert "| cores |" in section and "| torch |" in section
    # Only the results folder (rank results, profiles) is left in the work folder.
    assert [p.name for p in work.iterdir()] == ["out"]


@pytest.mark.slow
def test_write_section_replaces_only_its_section(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_dist", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_dist", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "new.md"
    bench.write_section(out, "first")
    text = out.read_text()
    assert text.startswith("# stepvault benchmarks")
    assert "<!-- dist:begin -->\nfirst\n<!-- dist:end -->" in text
    out.write_text(text + "\n## Other section\n")
    bench.write_section(out, "second")
    text = out.read_text()
    assert "first" not in text and "second" in text and "## Other section" in text
