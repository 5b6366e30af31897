"""Sizes, durations, byte counts and times have one home (``stepvault._units``): every
option that takes one accepts the same forms and names itself when it refuses one."""

from __future__ import annotations

import json
import time

import pytest
import torch
from typer.testing import CliRunner

import stepvault
from stepvault._units import format_time, human_bytes, parse_duration, parse_size
from stepvault.cli.main import app
from stepvault.errors import PlanError
from stepvault.manager.options import StagingOptions
from stepvault.planning import plan


def test_one_size_grammar():
    assert parse_size("x", "8GB") == 8 * 10**9
    assert parse_size("x", "512MiB") == 512 << 20
    assert parse_size("x", " 1.5 gib ") == 3 << 29
    assert parse_size("x", "1e9") == 10**9
    assert parse_size("x", 4096) == 4096
    for bad in ("8 gigs", True, "GB", 1.5, None, -1, "-3MB"):
        with pytest.raises(ValueError, match=r"^x must be .*such as '8GB'"):
            parse_size("x", bad)


def test_sizes_mean_the_same_to_the_manager_and_the_planner():
    # "1e9" was refused by the manager and taken by the planner; now both take it
    assert StagingOptions(memory="1e9").memory == 10**9
    p = plan(size="1e9", mtbf="24h", save_cost=60, step_time=2, total_steps=10, simulate_trials=0)
    assert p.inputs["sizes"]["value"]["full"]["stored_bytes"] == 10**9
    with pytest.raises(PlanError, match="--size"):
        plan(size="lots", mtbf="24h", save_cost=60, step_time=2, total_steps=10)


def test_one_duration_grammar():
    assert parse_duration("t", "90s") == 90.0
    assert parse_duration("t", "30min") == parse_duration("t", "30m") == 1800.0
    assert parse_duration("t", "2w") == 14 * 86400.0
    assert parse_duration("t", 12) == 12.0
    for bad in ("soon", "1x", float("inf"), True):
        with pytest.raises(ValueError, match=r"^t: bad duration"):
            parse_duration("t", bad)
    for bad in ("-5s", -1):
        with pytest.raises(ValueError, match=r"^t must not be negative"):
            parse_duration("t", bad)


def test_every_duration_option_of_the_cli_takes_the_same_forms(tmp_path):
    stepvault.save(tmp_path, {"model": torch.nn.Linear(2, 2)}, run="r", step=1)
    runner = CliRunner()
    # weeks: refused by `hold --ttl` and `gc --keep-within` before (s/m/h/d only)
    out = runner.invoke(app, ["--root", str(tmp_path), "hold", "r@1", "--ttl", "1w", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["expires"] == pytest.approx(time.time() + 7 * 86400, abs=60)
    args = ["--root", str(tmp_path), "gc", "r", "--keep-within", "2w", "--dry-run"]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["--root", str(tmp_path), "ls", "r", "--since", "1w", "--json"])
    assert out.exit_code == 0 and [r["step"] for r in json.loads(out.output)] == [1]
    # a bad one is a usage error naming the option
    out = runner.invoke(app, ["--root", str(tmp_path), "hold", "r@1", "--ttl", "soon"])
    assert out.exit_code == 2 and "--ttl: bad duration 'soon'" in out.output


def test_bytes_and_times_print_one_way():
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(10) == "10 B"
    assert human_bytes(3 * 2**40) == "3.0 TiB" and human_bytes(None) == ""
    assert format_time(0) == "?" and format_time(None, missing="") == ""
    assert format_time(86400 * 365)[:4] in ("1970", "1971")
