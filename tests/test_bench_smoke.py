"""benchmarks/bench_core.py writes only its own section (a tiny run of it is part of
tests/test_bench_run_all.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_core.py"


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
