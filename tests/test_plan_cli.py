"""``stepvault plan`` as users run it: a new process, the table, --json, --plot, errors."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli_in_new_process

import stepvault
from stepvault.policy import Every

JOB = ["--mtbf", "24h", "--save-cost", "60", "--step-time", "2", "--total-steps", "200000"]


def _cli(*args: str, code: int = 0) -> tuple[str, str, bool]:
    env = {"COLUMNS": "160", "PATH": "/usr/bin:/bin"}  # a fixed width: stable tables
    out, err, mods = cli_in_new_process(*args, code=code, env=env)
    return out, err, mods["torch"]


def test_plan_json_schema_for_a_job_without_torch():
    out, _, torch_loaded = _cli(
        "plan",
        *JOB,
        "--save",
        "Every(steps=1000)",
        "--keep",
        "KeepLast(3) | KeepEvery(steps=50000)",
        "--tiers",
        "HotLast(2) | CopyEvery('archive', steps=10000)",
        "--size",
        "14GB",
        "--new-size",
        "12GB",
        "--price",
        "hot=0.08/GB-month",
        "--trials",
        "300",
        "--json",
    )
    assert not torch_loaded  # planning needs numpy and the policies, not torch
    doc = json.loads(out)
    assert doc["schema"] == "stepvault-plan/1"
    assert set(doc) == {
        "schema",
        "run",
        "inputs",
        "interval",
        "goodput",
        "rto_seconds",
        "storage",
        "curve",
        "assumptions",
    }
    assert doc["interval"]["optimum_policy"] == "Every(steps=1590)"
    assert doc["interval"]["current_steps"] == 1000
    for g in doc["goodput"].values():
        assert {
            "ettr",
            "saves",
            "wall_seconds",
            "save_seconds",
            "restart_seconds",
            "lost_seconds",
            "failures",
            "rpo_seconds",
            "rpo_steps",
            "simulated",
        } <= set(g)
        assert abs(g["simulated"]["relative_difference"]) < 0.02
    assert doc["goodput"]["optimum"]["ettr"] > doc["goodput"]["current"]["ettr"]
    tiers = doc["storage"]["tiers"]
    assert tiers["hot"]["price_per_gb_month"] == 0.08  # given
    assert tiers["archive"]["price_per_gb_month"] == 0.023  # the documented example default
    assert tiers["archive"]["checkpoints_end"] == 20
    # 20 archived checkpoints: 2 GB shared once + 12 GB new each
    assert tiers["archive"]["bytes_end"] == 2 * 10**9 + 20 * 12 * 10**9
    assert doc["storage"]["cost_run"] == pytest.approx(
        tiers["hot"]["cost_run"] + tiers["archive"]["cost_run"]
    )


def test_plan_table_names_every_section():
    out, _, _ = _cli(
        "plan", *JOB, "--save", "Every(steps=1000)", "--size", "1GB", "--trials", "100"
    )
    for text in (
        "checkpoint interval",
        "Young",
        "Daly (2006)",
        "current policy",
        "goodput",
        "ETTR",
        "simulated (exponential)",
        "RPO",
        "RTO",
        "storage over the run",
        "assumed:",
    ):
        assert text in out, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mtbf", "0"], "--mtbf"),
        (["--save-cost", "-5"], "--save-cost"),
        (["--size", "0GB"], "--size"),
        (["--size", "1GB", "--price", "hot=-1"], "--price hot"),
        (["--keep", "__import__('os').system('echo hi')", "--size", "1GB"], "not a policy"),
        (["--failures", "weibull"], "--weibull-shape"),
        (["--failures", "gamma"], "--failures"),
    ],
)
def test_bad_input_exits_2_naming_the_option(args, message):
    opts = dict(zip(JOB[::2], JOB[1::2]))
    for key in args[::2]:
        opts.pop(key, None)
    base = [x for kv in opts.items() for x in kv]
    _, err, _ = _cli("plan", *base, *args, "--trials", "10", code=2)
    assert message in err.replace("\n", " ")


def test_plan_of_a_measured_run_without_torch(tmp_path):
    model = torch.nn.Linear(300, 300)
    state = {"model": model, "step": 0}
    with stepvault.CheckpointManager(
        tmp_path, run="r", save=Every(steps=2), async_save=True
    ) as mgr:
        for step in range(1, 11):
            with torch.no_grad():
                model.weight.add_(0.01)
            state["step"] = step
            mgr.save(step, state)
    out, _, torch_loaded = _cli(
        "--root",
        str(tmp_path),
        "plan",
        "r",
        "--mtbf",
        "12h",
        "--total-steps",
        "2000",
        "--trials",
        "100",
        "--json",
    )
    assert not torch_loaded
    doc = json.loads(out)
    assert doc["inputs"]["asynchronous"]["value"] is True
    assert doc["inputs"]["save_policy"] == {
        "value": "Every(steps=2)",
        "source": "measured: median steps between saves",
    }
    assert doc["inputs"]["sizes"]["value"]["full"]["stored_bytes"] >= 300 * 300 * 4
    _, err, _ = _cli("--root", str(tmp_path), "plan", "nosuch", "--mtbf", "1h", code=2)
    assert "no events and no checkpoints" in err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the 'plot' extra (matplotlib)")
    png = tmp_path / "plan.png"
    out, _, _ = _cli(
        "plan",
        *JOB,
        "--save",
        "Every(steps=1000)",
        "--keep",
        "KeepLast(3)",
        "--tiers",
        "HotLast(2) | CopyEvery('archive', steps=10000)",
        "--size",
        "14GB",
        "--trials",
        "100",
        "--plot",
        str(png),
    )
    assert f"figure written to {png}" in out.replace("\n", "")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_stepvault_plan_is_the_function():
    p = stepvault.planning.plan(
        mtbf="24h", save_cost=60, step_time=2, total_steps=10_000, simulate_trials=0
    )
    assert p.interval["young_seconds"] == pytest.approx((2 * 60 * 86400) ** 0.5)
    assert "planning" in stepvault.__all__
