"""A CLI that never lies (issue 28): verify, show, diff and export see every tier as restore
does; an unknown run is an error naming the runs that exist; identifiers are never cut in a
pipe or an 80-column terminal, piped output is plain; size figures say what they count; and
``plan`` answers the interval from the save cost and the MTBF alone.

Each test drives the real command line (typer's CliRunner, whose output is a pipe, not a
terminal, 80 columns wide; or a console forced to be an 80-column terminal)."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from typer.testing import CliRunner

import stepvault
from stepvault.cli import output
from stepvault.cli.main import app
from stepvault.format.hashing import content_hash

BOX = set("┏┓┗┛┃━│─┡┩╇╋┼")


class Wide(torch.nn.Module):
    """Identifiers longer than an 80-column table cell."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer_encoder_block_attention_projection = torch.nn.Linear(8, 8)
        self.transformer_encoder_block_feedforward_output = torch.nn.Linear(8, 4)


NAMES = [
    "model/transformer_encoder_block_attention_projection.weight",
    "model/transformer_encoder_block_feedforward_output.bias",
]


def cli(root, *args: str):
    return CliRunner().invoke(app, ["--root", str(root), *args])


@pytest.fixture()
def tiered(tmp_path):
    """Three checkpoints of run r; r@2 moved to the archive and evicted from hot."""
    torch.manual_seed(0)
    hot = tmp_path / "hot"
    m = Wide()
    opt = torch.optim.AdamW(m.parameters())
    weights = {}
    for step in (1, 2, 3):
        x = m.transformer_encoder_block_attention_projection(torch.randn(2, 8))
        m.transformer_encoder_block_feedforward_output(x).sum().backward()
        opt.step()
        weights[step] = {k: v.clone() for k, v in m.state_dict().items()}
        stepvault.save(hot, {"model": m, "optimizer": opt}, run="r", step=step)
    assert cli(hot, "tiers", "add", "archive", str(tmp_path / "archive")).exit_code == 0
    res = cli(hot, "tier", "r@2", "--to", "archive", "--evict")
    assert res.exit_code == 0, res.output
    return hot, weights


def test_a_checkpoint_only_in_the_archive_registers_promotes_and_is_held_there(tiered):
    """register/promote/lineage used to read the hot tier alone ("no committed checkpoint
    r@2") for a checkpoint a restore reads fine from the archive."""
    hot, _ = tiered
    res = cli(hot, "promote", "m", "r@2", "--alias", "stable")
    assert res.exit_code == 0, res.output
    assert "m@stable -> v1" in res.stdout
    res = cli(hot, "lineage", "m@stable")
    assert res.exit_code == 0 and "checkpoint r@2" in res.stdout, res.output
    # held where each retention looks: hot (gc, `holds`) and the archive (its own keep)
    assert (hot / "refs/holds/r/2@m.v1.json").is_file()
    assert (hot.parent / "archive/refs/holds/r/2@m.v1.json").is_file()
    res = cli(hot, "verify", "--json")  # its registry check reads the archive too
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["registry"] == []  # problems only: r@2 is not "gone"


def test_sign_and_verify_signatures_cover_archive_copies(tiered, tmp_path):
    hot, _ = tiered
    assert cli(hot, "keygen", str(tmp_path / "team")).exit_code == 0
    key, pub = str(tmp_path / "team.key"), str(tmp_path / "team.pub")
    res = cli(hot, "sign", "r", "--key", key, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["signed"] == 3  # r@2 lives in the archive only
    res = cli(hot, "verify", "--signatures", "--key", pub, "--require", "--json")
    assert res.exit_code == 0, res.output
    manifests = [
        e for e in json.loads(res.stdout)["signatures"]["entries"] if e["kind"] == "manifest"
    ]
    assert [(e["ref"], e["status"]) for e in manifests] == [
        ("r@1", "valid"),
        ("r@2 (in archive)", "valid"),
        ("r@3", "valid"),
    ]
    # an archive copy altered (checksum recomputed) is caught, and named with its tier
    path = hot.parent / "archive/runs/r/checkpoints/2.json"
    envelope, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(body)
    doc["metrics"] = {"val_loss": 0.01}  # a forged metric
    body = json.dumps(doc, separators=(",", ":")).encode()
    env = {**json.loads(envelope), "body_blake3": content_hash(body), "body_size": len(body)}
    path.write_bytes(json.dumps(env, separators=(",", ":")).encode() + b"\n" + body)
    assert cli(hot, "verify", "r@2").exit_code == 0  # the checksum alone cannot tell
    res = cli(hot, "verify", "--signatures", "--key", pub, "--json")
    assert res.exit_code == 1, res.output
    bad = json.loads(res.stdout)["signatures"]["problems"]
    assert [(e["ref"], e["status"]) for e in bad] == [("r@2 (in archive)", "invalid")]


def test_a_checkpoint_only_in_the_archive_verifies_there_and_says_so(tiered, tmp_path):
    hot, weights = tiered
    # it restores fine from the archive...
    m = Wide()
    stepvault.restore(hot, {"model": m}, run="r", step=2, strict=False)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in weights[2].items())
    # ...so verify must not call it damaged, nor miss it in the store's count
    res = cli(hot, "verify")
    assert res.exit_code == 0, res.output
    assert "ok       r@2  (in archive)" in res.stdout
    assert "3 checkpoints" in res.stdout and "0 damaged" in res.stdout
    res = cli(hot, "verify", "r@2", "--deep", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["checkpoints"] == [
        {"run": "r", "step": 2, "ok": True, "problems": [], "tiers": ["archive"]}
    ]
    assert doc["objects_checked"] >= 1
    # show, diff and export read it too
    res = cli(hot, "show", "r@2")
    assert res.exit_code == 0 and "tiers: archive" in res.stdout
    assert json.loads(cli(hot, "show", "r@2", "--json").stdout)["tiers"] == ["archive"]
    res = cli(hot, "diff", "r@1", "r@2")
    assert res.exit_code == 0, res.output
    out = tmp_path / "w.safetensors"
    res = cli(hot, "export", "r@2", "-o", str(out))
    assert res.exit_code == 0, res.output
    exported = load_file(str(out))
    assert all(torch.equal(exported[k], v) for k, v in weights[2].items())


def test_verify_of_a_run_that_does_not_exist_is_an_error_naming_the_runs(tiered):
    hot, _ = tiered
    for args in (["verify", "nosuchrun"], ["verify", "nosuchrun", "--json"]):
        res = cli(hot, *args)
        assert res.exit_code == 2, res.output
        assert "no run 'nosuchrun'" in res.stderr and "runs: r" in res.stderr
        assert '"ok": true' not in res.stdout and "Traceback" not in res.output
    res = cli(hot, "verify", "rr")
    assert res.exit_code == 2 and "did you mean 'r'?" in res.stderr
    res = cli(hot, "verify", "r@9")
    assert res.exit_code == 2 and "no checkpoint r@9 in any tier" in res.stderr
    assert "1, 2, 3" in res.stderr


def test_identifiers_are_whole_and_plain_in_a_pipe(tiered):
    hot, _ = tiered
    res = cli(hot, "diff", "r@1", "r@3")
    assert res.exit_code == 0, res.output
    for name in NAMES:
        assert any(line.split()[0] == name for line in res.stdout.splitlines() if line.strip())
    assert "…" not in res.stdout and not BOX & set(res.stdout)
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("tensors: ") and "{" not in last  # counts in words, not raw JSON
    assert "changed" in last
    res = cli(hot, "show", "r@1", "--tensors")
    assert res.exit_code == 0 and "…" not in res.stdout and not BOX & set(res.stdout)
    assert all(name.removeprefix("model/") in res.stdout or name in res.stdout for name in NAMES)
    # events: one line per event, not a table wrapped to several lines each
    res = cli(hot, "events", "r")
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    events = json.loads(cli(hot, "events", "r", "--json").stdout)
    assert len(lines) == len(events) + 2  # title, header, one line per event
    assert not BOX & set(res.stdout)


def test_identifiers_are_whole_in_an_80_column_terminal(tiered, monkeypatch):
    hot, _ = tiered
    monkeypatch.setattr(output, "console", Console(force_terminal=True, width=80))
    res = cli(hot, "diff", "r@1", "r@3")
    assert res.exit_code == 0, res.output
    assert "…" not in res.stdout
    for name in NAMES:
        assert name in res.stdout
    # a terminal wide enough draws the table
    monkeypatch.setattr(output, "console", Console(force_terminal=True, width=200))
    res = cli(hot, "diff", "r@1", "r@3")
    assert res.exit_code == 0 and BOX & set(res.stdout)
    assert all(name in res.stdout for name in NAMES)


def test_plan_headers_are_whole():
    res = CliRunner().invoke(
        app,
        [
            "plan",
            *("--save-cost", "60", "--mtbf", "24h", "--step-time", "1", "--duration", "30d"),
            *("--size", "1GB", "--price", "hot=0.10/GB-month", "--trials", "0"),
        ],
    )
    assert res.exit_code == 0, res.output
    for header in ("checkpoints", "$/GB-month", "$/month after", "compute between saves"):
        assert header in res.stdout
    assert "…" not in res.stdout and not BOX & set(res.stdout)


def test_plan_answers_the_interval_from_the_save_cost_and_mtbf_alone():
    res = CliRunner().invoke(app, ["plan", "--save-cost", "60", "--mtbf", "24h"])
    assert res.exit_code == 0, res.output
    # Daly: sqrt(2 * 60 * 86400) * (1 + ...) - 60 ~ 53.0 min; Young sqrt(2CM) = 53.7 min
    assert "save every 53.0 min of compute" in res.stdout
    assert "53.7 min" in res.stdout
    assert "assumed: failures arrive at a constant rate (exponential) with MTBF 24.0 h" in (
        res.stdout
    )
    assert "--step-time" in res.stdout  # what to give for steps, goodput and the bill
    res = CliRunner().invoke(app, ["plan", "--save-cost", "60", "--mtbf", "24h", "--json"])
    doc = json.loads(res.stdout)
    assert doc["interval"]["young_seconds"] == pytest.approx((2 * 60 * 86400) ** 0.5)
    assert 3170 < doc["interval"]["daly_seconds"] < 3190
    assert doc["assumptions"]
    res = CliRunner().invoke(app, ["plan", "--save-cost", "60"])
    assert res.exit_code == 2 and "--mtbf" in res.stderr and "Traceback" not in res.output


def test_size_figures_of_a_small_checkpoint_say_what_they_count(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, {"w": torch.zeros(4), "note": "x" * 300}, run="r", step=1)
    res = cli(root, "du")
    assert res.exit_code == 0, res.output
    assert "compression saved -" not in res.stdout
    assert "object headers and framing add" in res.stdout
    ratio_line = next(ln for ln in res.stdout.splitlines() if ln.startswith("stored / logical"))
    assert "non-tensor state" in ratio_line  # a ratio above 1 is explained
    res = cli(root, "show", "r@1")
    assert "logical: 16 B (tensor data)" in res.stdout
    assert "object headers" in res.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["verify", "--json"],
        ["verify", "r@2", "--json"],
        ["show", "r@2", "--json"],
        ["diff", "r@1", "r@2", "--json"],
        ["events", "r", "--json"],
        ["du", "--json"],
    ],
)
def test_json_parses(tiered, args):
    hot, _ = tiered
    res = cli(hot, *args)
    assert res.exit_code == 0, res.output
    json.loads(res.stdout)


def test_ls_marks_a_checkpoint_a_restore_found_damaged(tmp_path):
    from helpers import flip_byte, object_path

    from stepvault import CheckpointManager

    root = tmp_path / "s"
    torch.manual_seed(0)
    state = {"w": torch.randn(1000), "step": 0}
    with CheckpointManager(root, run="r", async_save=False) as mgr:
        for step in (1, 2):
            state["w"] += 1
            state["step"] = step
            mgr.save(step, state, force=True)
    vault = stepvault.open(root)
    only2 = set(vault.manifest("r", 2).objects) - set(vault.manifest("r", 1).objects)
    flip_byte(object_path(root, next(iter(only2))))
    with CheckpointManager(root, run="r", async_save=False) as mgr:
        info = mgr.restore({"w": torch.zeros(1000), "step": 0})
    assert info is not None and info.step == 1 and [k.step for k in info.skipped] == [2]
    res = cli(root, "ls", "r")
    assert res.exit_code == 0, res.output
    line2 = next(ln for ln in res.stdout.splitlines() if ln.split()[:1] == ["2"])
    assert "DAMAGED: a restore skipped it" in line2
    line1 = next(ln for ln in res.stdout.splitlines() if ln.split()[:1] == ["1"])
    assert "DAMAGED" not in line1
    rows = {r["step"]: r for r in json.loads(cli(root, "ls", "r", "--json").stdout)}
    assert rows[2]["valid"] is False and rows[1]["valid"] is True


def test_listings_of_runs_and_tiers_are_plain_and_whole_in_a_pipe(tiered, tmp_path):
    hot, _ = tiered
    long_run = "pretrain-llama-7b-lr3e-4-warmup2000-cosine-seed1234-ablation-no-dropout"
    stepvault.save(hot, {"w": torch.zeros(2)}, run=long_run, step=1)
    res = cli(hot, "ls")
    assert res.exit_code == 0, res.output
    assert any(ln.split()[:1] == [long_run] for ln in res.stdout.splitlines())
    assert not BOX & set(res.stdout)
    res = cli(hot, "tiers", "ls")
    assert res.exit_code == 0, res.output
    assert str(tmp_path / "archive") in res.stdout and str(hot) in res.stdout
    assert "…" not in res.stdout and not BOX & set(res.stdout)


def _commands() -> dict[str, object]:
    import typer.main

    out: dict[str, object] = {}

    def walk(group: object, prefix: str) -> None:
        for name, cmd in getattr(group, "commands", {}).items():
            if hasattr(cmd, "commands"):
                walk(cmd, f"{prefix}{name} ")
            else:
                out[prefix + name] = cmd

    walk(typer.main.get_command(app), "")
    return out


def test_every_command_takes_json_and_the_new_ones_parse(tiered, tmp_path):
    exempt = {"ui"}  # a web server, not a report
    lacking = [
        name
        for name, cmd in _commands().items()
        if name not in exempt
        and "--json" not in [o for p in cmd.params for o in getattr(p, "opts", [])]  # type: ignore[attr-defined]
    ]
    assert lacking == []
    hot, _ = tiered
    key = tmp_path / "team"
    doc = json.loads(CliRunner().invoke(app, ["keygen", str(key), "--json"]).stdout)
    assert doc["public_key"] == f"{key}.pub" and doc["key_id"]
    res = cli(hot, "sign", "r", "--key", f"{key}.key", "--json")
    assert res.exit_code == 0, res.output
    signed = json.loads(res.stdout)
    assert signed["run"] == "r" and signed["signed"] >= 2 and signed["key_id"] == doc["key_id"]
    res = cli(hot, "tiers", "add", "cold2", str(tmp_path / "c2"), "--json")
    assert json.loads(res.stdout) == {"name": "cold2", "url": str(tmp_path / "c2"), "codec": "keep"}
    res = cli(hot, "tiers", "remove", "cold2", "--json")
    assert json.loads(res.stdout) == {"name": "cold2", "removed": True}
    res = cli(hot, "pin", "r@1", "--note", "paper", "--json")
    assert json.loads(res.stdout) == {"run": "r", "step": 1, "pinned": True, "note": "paper"}
    res = cli(hot, "unpin", "r@1", "--json")
    assert json.loads(res.stdout) == {"run": "r", "step": 1, "pinned": False}
    assert cli(hot, "hold", "r@3", "--ttl", "1h").exit_code == 0
    res = cli(hot, "release", "r@3", "--json")
    assert json.loads(res.stdout) == {"run": "r", "step": 3, "released": 1}


def test_the_python_exporters_read_every_tier_too(tiered, tmp_path):
    from stepvault.ops import export_weights
    from stepvault.ops.export_hf import export_checkpoint
    from stepvault.store import Store

    hot, weights = tiered
    for name, export in (("a", export_weights), ("b", export_checkpoint)):
        out = tmp_path / f"{name}.safetensors"
        export(Store.open(hot), "r", 2, out)  # a plain Store of the hot tier
        exported = load_file(str(out))
        assert all(torch.equal(exported[k], v) for k, v in weights[2].items())
