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


def test_bench_replication_writes_its_section_with_the_manager_rows(tmp_path):
    """A tiny run of the replication benchmark (not in run_all: it needs 2 ranks' memory):
    both A/B tables and the restart, and only its own section of the file is rewritten."""
    import subprocess

    out = tmp_path / "B.md"
    out.write_text("# keep me\n<!-- replication:begin -->\nold\n<!-- replication:end -->\ntail\n")
    script = REPO / "benchmarks" / "bench_replication.py"
    args = ["--size-mb", "2", "--saves", "1", "--iters", "5", "--workdir", str(tmp_path)]
    res = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# keep me") and text.rstrip().endswith("tail") and "old" not in text
    assert "Stall with replication / without:" in text
    assert "| rank 1 (node n1) | peer |" in text  # the wiped node restored from its buddy


def test_bench_pipeline_writes_its_section_with_every_row(tmp_path):
    """A tiny run of the pipeline benchmark (issue 27's rows); only its section is rewritten
    and every row has a measurement."""
    import json
    import subprocess

    out = tmp_path / "B.md"
    out.write_text("# keep me\n<!-- pipeline:begin -->\nold\n<!-- pipeline:end -->\ntail\n")
    script = REPO / "benchmarks" / "bench_pipeline.py"
    args = ["--checkpoints", "40", "--saves", "5", "--rounds", "1", "--other", "10"]
    args += ["--dist-saves", "2", "--mem-mb", "8", "--mem-saves", "2"]
    args += [
        "--requests-long",
        "20",
        "--workdir",
        str(tmp_path),
        "--json",
        str(tmp_path / "p.json"),
    ]
    res = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# keep me") and text.rstrip().endswith("tail") and "old" not in text
    doc = json.loads((tmp_path / "p.json").read_text())
    assert len(doc["rows"]) == 6
    assert doc["retention"]["other_runs"] == 0  # a retention save reads no other run
    assert doc["mark"]["parsed_with_lists"] == 0
    # A 2-rank collective restore: the chosen manifest parsed once per rank, one broadcast
    # (the code before issue 27: 4-5 parses and 3 broadcasts per rank).
    ranks = doc["collective"]["ranks"]
    assert [(r["chosen_parses"], r["broadcasts"]) for r in ranks] == [(1, 1), (1, 1)], ranks
    assert doc["collective"]["bitwise"]
    # The mem tier: every chunk hashed once per save for memory + disk (it was twice).
    for save in doc["mem"]["saves"]:
        assert save["tier"] == "mem+hot" and save["times_each_chunk_hashed"] == [1], save
        assert save["hashed_by_module"]["stepvault.engine.writer"] == save["chunk_bytes"], save
    assert all(r["verdict"] == "PASS" for r in doc["rows"][-2:]), doc["rows"][-2:]
