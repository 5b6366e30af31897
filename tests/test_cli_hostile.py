"""The CLI never lies or crashes (issue 28): every command, given hostile or wrong
arguments, exits 2 with one ``error:`` line and no traceback; a name that does not exist
is an error naming the runs there are; ``gc --dry-run`` counts what the deletion would
free and what the grace period holds back; a registry hold is not a pin.

Shaped like a user at a terminal: the real ``stepvault`` app through typer's CliRunner.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app
from stepvault.store import Store

RUN = "exp1"


def _fill(root: Path, steps: range = range(1, 5)) -> None:
    model = torch.nn.Linear(32, 32)
    with stepvault.CheckpointManager(root, RUN) as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1)
            mgr.save(step, {"model": model}, metrics={"val_loss": 1.0 / step})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "store"
    _fill(root)
    return root


def invoke(*args: str) -> typing.Any:
    return CliRunner().invoke(app, list(args))


def assert_usage_error(res: typing.Any, *needles: str) -> str:
    """Exit 2, exactly one line of output starting with ``error:``, no traceback."""
    what = f"exit {res.exit_code}: {res.output!r}"
    assert res.exception is None or isinstance(res.exception, SystemExit), (
        what,
        res.exception,
    )
    assert "Traceback" not in res.output, what
    assert res.exit_code == 2, what
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), what
    for needle in needles:
        assert needle in lines[0], what
    return lines[0]


# ------------------------------------------------------------- every command, enumerated
def _commands() -> dict[str, typing.Callable[..., typing.Any]]:
    """Every command of the app, by its path (``tiers ls``), with its function."""
    found = {c.name: c.callback for c in app.registered_commands}
    for group in app.registered_groups:
        for c in group.typer_instance.registered_commands:
            found[f"{group.name} {c.name}"] = c.callback
    return found  # type: ignore[return-value]


def _options(callback: typing.Callable[..., typing.Any]) -> dict[str, tuple[str, type]]:
    """``{param: (--option, base type)}`` of a command's options, from its annotations."""
    out = {}
    for name, hint in typing.get_type_hints(callback, include_extras=True).items():
        if typing.get_origin(hint) is not typing.Annotated:
            continue
        base, *meta = typing.get_args(hint)
        decls = [d for m in meta for d in getattr(m, "param_decls", ()) or () if d.startswith("--")]
        if not decls and type(meta[0]).__name__ != "OptionInfo":
            continue  # an argument
        flag = decls[0] if decls else "--" + name.replace("_", "-")
        kinds = [a for a in typing.get_args(base) if a is not type(None)] or [base]
        out[name] = (flag, kinds[0])
    return out


#: Harmless, otherwise valid arguments of each command (hostile ones replace a piece).
#: A new command must be added here: the test below fails until it is.
def _base(tmp: Path) -> dict[str, list[str]]:
    nowhere = str(tmp / "no-such-path")
    return {
        "ls": [RUN],
        "show": [f"{RUN}@1"],
        "verify": [RUN],
        "du": [],
        "repair": [RUN, "--dry-run"],
        "export": [f"{RUN}@1", "-o", str(tmp / "export")],
        "import-dcp": [nowhere, "--run", "imp", "--step", "1"],
        "import": [nowhere, "--run", "imp", "--step", "1"],
        "migrate": [nowhere, "--run", "imp", "--step", "1"],  # the same command as import
        "gc": [RUN, "--dry-run"],
        "pin": [f"{RUN}@1"],
        "unpin": [f"{RUN}@1"],
        "events": [RUN],
        "attach": [f"{RUN}@1", nowhere],
        "diff": [f"{RUN}@1", f"{RUN}@2"],
        "verify-export": [nowhere],
        "hold": [f"{RUN}@1"],
        "holds": [RUN],
        "release": [f"{RUN}@1"],
        "tier": [f"{RUN}@1", "--to", "archive"],
        "plan": [RUN, "--mtbf", "24h", "--save-cost", "60", "--trials", "0"],
        "annotate": [f"{RUN}@1", "val_loss=1"],
        "register": ["m", f"{RUN}@1"],
        "promote": ["m", "1", "--alias", "prod"],
        "rollback": ["m", "--alias", "prod"],
        "models": [],
        "lineage": [RUN],
        "keygen": [str(tmp / "key")],
        "sign": [RUN, "--key", "hmac:" + "ab" * 16],
        "ui": [],
        "tiers ls": [RUN],
        "tiers add": ["archive", str(tmp / "cold")],
        "tiers remove": ["archive"],
        "tiers du": [],
        "tiers mem-gc": ["--dry-run"],
    }


#: Commands whose base names a missing path, which they may report before opening --root.
CHECKS_ITS_PATH_FIRST = {"verify-export", "import", "import-dcp", "migrate", "attach"}
#: Count options for which 0 is a meaningful value (everything else must be 1 or more).
ZERO_OK = {("ls", "--limit"), ("events", "--tail"), ("plan", "--trials"), ("plan", "--seed")}
#: Options whose 0 would start something long-lived (a server on any free port).
NEVER_RUN = {("ui", "--port")}


def test_the_table_covers_every_command(tmp_path: Path) -> None:
    assert set(_commands()) - set(_base(tmp_path)) == set()


def test_a_file_as_root_is_one_line_for_every_command(store: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-store.txt"
    a_file.write_text("hello")
    for path, callback in _commands().items():
        if "root" not in _options(callback):
            continue
        args = [*path.split(), *_base(tmp_path)[path]]
        # (the base's own missing path may be what a command reports first)
        needle = "" if path in CHECKS_ITS_PATH_FIRST else "is a file, not a store"
        assert_usage_error(invoke("--root", str(a_file), *args), needle)
        assert_usage_error(invoke(*args, "--root", str(a_file)), needle)


def test_negative_and_zero_counts_for_every_command(store: Path, tmp_path: Path) -> None:
    checked = 0
    for path, callback in _commands().items():
        for flag, kind in _options(callback).values():
            if kind is not int:
                continue
            args = [*path.split(), *_base(tmp_path)[path]]
            if flag in args:  # the base sets it: replace its value
                at = args.index(flag)
                args = args[:at] + args[at + 2 :]
            if (path, flag) != ("plan", "--seed"):
                assert_usage_error(invoke("--root", str(store), *args, flag, "-3"))
                checked += 1
            if (path, flag) in ZERO_OK or (path, flag) in NEVER_RUN:
                continue
            assert_usage_error(invoke("--root", str(store), *args, flag, "0"))
            checked += 1
    assert checked >= 12  # gc's four counts, ls, events, import(-dcp) --step, plan, ui
    assert Store.open(store).list_steps(RUN) == [1, 2, 3, 4]  # nothing was deleted


@pytest.mark.parametrize(
    "args, needle",
    [
        (["gc", RUN, "--keep-last", "0"], "--keep-last must be 1 or more, got 0"),
        (["gc", RUN, "--keep-last", "-3"], "--keep-last must be 1 or more, got -3"),
        (["gc", RUN, "--keep-every", "0"], "--keep-every must be 1 or more"),
        (["gc", RUN, "--keep-best", "1", "--metric", "val_loss", "--mode", "up"], "--mode"),
        (["gc", RUN, "--grace", "soon"], "--grace"),
        (["gc", RUN, "--keep-last", "abc"], "--keep-last"),
        (["ls", RUN, "--limit", "-1"], "--limit"),
        (["events", RUN, "--tail", "-2"], "--tail"),
        (["pin", f"{RUN}@x"], "bad checkpoint reference"),
        (["pin", "@@"], "bad checkpoint reference"),
        (["pin", RUN], "exact step"),
        (["unpin", "bad name@1"], "invalid run name"),
        (["pin", f"{RUN}@77"], f"no committed checkpoint {RUN}@77"),
        (["unpin", f"{RUN}@77"], f"no committed checkpoint {RUN}@77"),
        (["unpin", f"{RUN}@2"], f"{RUN}@2 is not pinned"),
        (["export", f"{RUN}@x", "-o", "out"], "bad checkpoint reference"),
        (["show", f"{RUN}@77"], f"{RUN}@77"),
        (["gc", RUN, "--thin-after", "0s", "--dry-run"], "--thin-after must be a positive age"),
        (["export", f"{RUN}@1", "-o", "out", "--max-shard-size", "0"], "max_shard_size must be"),
        (["lineage", "nomodel@stable"], "no model 'nomodel' in the registry"),
    ],
)
def test_wrong_values_are_one_line_errors(store: Path, args: list[str], needle: str) -> None:
    assert_usage_error(invoke("--root", str(store), *args), needle)


def test_an_unwritable_output_path_is_one_line(store: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "plain-file"
    a_file.write_text("x")
    under_a_file = str(a_file / "out")  # unwritable for anyone, root included
    for args in (
        ["export", f"{RUN}@1", "-o", under_a_file],
        ["export", f"{RUN}@1", "-o", under_a_file + ".safetensors"],
        ["keygen", under_a_file],
        ["tiers", "mem-gc", "--mem-root", str(a_file)],
    ):
        assert_usage_error(invoke("--root", str(store), *args), str(a_file))


# ------------------------------------------------------------- a typo is not a success
@pytest.mark.parametrize(
    "args",
    [
        ["ls", "exp"],
        ["events", "exp"],
        ["gc", "exp"],
        ["gc", "exp", "--keep-last", "1"],
        ["holds", "exp"],
        ["repair", "exp", "--dry-run"],
        ["pin", "exp@1"],
        ["unpin", "exp@1"],
        ["tiers", "ls", "exp"],
    ],
)
def test_a_run_that_does_not_exist_names_the_nearest(store: Path, args: list[str]) -> None:
    line = assert_usage_error(invoke("--root", str(store), *args), "no run 'exp'")
    assert f"did you mean '{RUN}'" in line


def test_an_unknown_run_far_from_any_lists_the_runs(store: Path) -> None:
    line = assert_usage_error(invoke("--root", str(store), "ls", "zzzzzz"), "no run 'zzzzzz'")
    assert f"runs: {RUN}" in line


def test_an_unknown_model_names_the_registered_ones(tmp_path: Path) -> None:
    _fill(tmp_path, range(1, 3))
    root = ["--root", str(tmp_path)]
    line = assert_usage_error(invoke(*root, "models", "llama"), "no model 'llama'")
    assert "it holds no models yet" in line  # nothing registered at all
    assert invoke(*root, "register", "llama", f"{RUN}@1").exit_code == 0
    line = assert_usage_error(invoke(*root, "models", "lama"), "no model 'lama'")
    assert "did you mean 'llama'" in line
    shown = invoke(*root, "models", "llama", "--json")
    assert shown.exit_code == 0 and '"model": "llama"' in shown.output


# ------------------------------------------------------------------- gc tells the truth
def test_gc_dry_run_counts_what_the_deletion_frees(tmp_path: Path) -> None:
    _fill(tmp_path, range(1, 9))
    base = ["--root", str(tmp_path), "gc", RUN, "--keep-last", "2"]
    dry = invoke(*base, "--dry-run", "--grace", "0s", "--json")
    assert dry.exit_code == 0, dry.output
    preview = json.loads(dry.output)
    assert preview["deleted_checkpoints"] == [1, 2, 3, 4, 5, 6]
    # each deleted step had its own weight (32x32 float32 = 4 KiB, + a header)
    assert preview["deleted_objects"] == 6 and preview["freed_bytes"] > 6 * 4096
    assert Store.open(tmp_path).list_steps(RUN) == list(range(1, 9))  # a dry run
    text = invoke(*base, "--dry-run", "--grace", "0s")
    assert "would delete 6 checkpoints and 6 objects" in text.output
    assert "would free 0 B" not in text.output
    real = json.loads(invoke(*base, "--grace", "0s", "--json").output)
    assert real["deleted_objects"] == preview["deleted_objects"]
    assert real["freed_bytes"] == preview["freed_bytes"]
    assert Store.open(tmp_path).list_steps(RUN) == [7, 8]


def test_gc_says_what_the_grace_period_holds_back(tmp_path: Path) -> None:
    _fill(tmp_path, range(1, 5))
    base = ["--root", str(tmp_path), "gc", RUN, "--keep-last", "1"]
    dry = invoke(*base, "--dry-run", "--json")  # the default grace: 15 min
    preview = json.loads(dry.output)
    assert preview["deleted_objects"] == 0 and preview["freed_bytes"] == 0
    assert preview["kept_in_grace"] == 3 and preview["kept_in_grace_bytes"] > 3 * 4096
    text = invoke(*base, "--dry-run")
    assert "3 unreferenced objects" in text.output and "would stay" in text.output
    assert "--grace 0s" in text.output
    real = invoke(*base)
    assert real.exit_code == 0, real.output
    assert "freed 0 B" in real.output and "younger than the grace period (15m)" in real.output
    assert "when no save is running, --grace 0s frees them now" in real.output
    after = json.loads(invoke("--root", str(tmp_path), "gc", "--grace", "0s", "--json").output)
    assert after["deleted_objects"] == 3 and after["freed_bytes"] == preview["kept_in_grace_bytes"]


# --------------------------------------------------------- a registry hold is not a pin
def test_a_registry_hold_is_named_and_not_unpinnable(tmp_path: Path) -> None:
    _fill(tmp_path, range(1, 5))
    root = ["--root", str(tmp_path)]
    assert invoke(*root, "register", "llama", f"{RUN}@2").exit_code == 0
    assert invoke(*root, "pin", f"{RUN}@3", "--note", "paper").exit_code == 0
    plan = invoke(*root, "gc", RUN, "--keep-last", "1", "--dry-run")
    assert plan.exit_code == 0, plan.output
    lines = plan.output.splitlines()
    rows = {ln.split()[1]: ln for ln in lines if ln.startswith(("keep", "delete"))}
    assert "held by the registry (model llama v1)" in rows["2"] and "pinned" not in rows["2"]
    assert "pinned" in rows["3"] and "registry" not in rows["3"]
    line = assert_usage_error(invoke(*root, "unpin", f"{RUN}@2"), f"{RUN}@2 is not pinned")
    assert "held by the registry (model llama v1)" in line
    unpinned = invoke(*root, "unpin", f"{RUN}@3")
    assert unpinned.exit_code == 0 and f"unpinned {RUN}@3" in unpinned.output
    events = json.loads(invoke(*root, "events", RUN, "--json").output)
    assert [e["step"] for e in events if e["event"] == "unpin"] == [3]  # one, the real one
