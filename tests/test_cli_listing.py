"""``stepvault ls RUN`` on a long run: the newest page by default, --limit, --since, plain
lines when not drawing a table, --json complete, and the summary cache left intact."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import stepvault
from stepvault.cli.listing import DEFAULT_LIMIT, parse_since, select_steps
from stepvault.cli.main import app

N = 60


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ls") / "store"
    w = torch.zeros(16)
    for step in range(1, N + 1):
        w[step % 16] = step
        stepvault.save(root, {"w": w}, run="r", step=step, metrics={"loss": 1 / step})
    return root


def ls(root, *args):
    res = CliRunner().invoke(app, ["--root", str(root), "ls", "r", *args])
    return res


def _steps(stdout: str) -> list[int]:
    return [int(line.split()[0]) for line in stdout.splitlines()[1:] if line.strip()]


def test_default_lists_the_newest_page_as_plain_lines(long_run):
    res = ls(long_run)
    assert res.exit_code == 0, res.output
    assert _steps(res.stdout) == list(range(N - DEFAULT_LIMIT + 1, N + 1))
    assert res.stdout.splitlines()[0].split()[:2] == ["step", "epoch"]
    assert f"newest {DEFAULT_LIMIT} of {N} checkpoints shown" in res.stderr
    assert "loss=0.01667" in res.stdout


def test_limit_and_since(long_run):
    assert _steps(ls(long_run, "--limit", "0").stdout) == list(range(1, N + 1))
    assert _steps(ls(long_run, "--limit", "3").stdout) == [N - 2, N - 1, N]
    assert _steps(ls(long_run, "--since", "50").stdout) == list(range(50, N + 1))
    assert _steps(ls(long_run, "--since", "50", "--limit", "2").stdout) == [N - 1, N]
    recent = ls(long_run, "--since", "1h", "--limit", "0")
    assert _steps(recent.stdout) == list(range(1, N + 1))
    for bad in (["--since", "yesterday"], ["--limit", "-1"]):
        res = ls(long_run, *bad)
        assert res.exit_code == 2 and ("--since" in res.output or "--limit" in res.output)


def test_json_is_complete_unless_limited(long_run):
    rows = json.loads(ls(long_run, "--json").stdout)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    rows = json.loads(ls(long_run, "--json", "--limit", "5").stdout)
    assert [r["step"] for r in rows] == list(range(N - 4, N + 1))


def test_a_page_does_not_shrink_the_summary_cache(long_run):
    cache = long_run / "runs" / "r" / "summaries.json"
    ls(long_run, "--limit", "0")  # a full listing compacts the cache
    before = cache.read_bytes()
    ls(long_run, "--limit", "5")
    assert cache.read_bytes() == before and len(json.loads(before.partition(b"\n")[2])) == N


def test_damaged_checkpoint_in_plain_lines(tmp_path):
    for step in (1, 2):
        stepvault.save(tmp_path, {"w": torch.ones(4) * step}, run="r", step=step)
    path = tmp_path / "runs" / "r" / "checkpoints" / "2.json"
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    os.sync()
    res = ls(tmp_path)
    assert res.exit_code == 0 and "2  DAMAGED:" in res.stdout


def test_helpers():
    assert parse_since("1200") == (1200, None)
    assert parse_since("90s") == (None, 90.0) and parse_since("2h") == (None, 7200.0)
    assert select_steps([1, 5, 9, 12], limit=2, since_step=5) == ([9, 12], 3)
    assert select_steps([1, 5, 9, 12], limit=0, since_step=None) == ([1, 5, 9, 12], 4)
