"""``stepvault plan``: the checkpoint interval, goodput, RPO/RTO and storage bill.

Only the planning package is imported (numpy, the policies): no torch.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from ..errors import StepvaultError
from .common import JsonOpt, RootOpt, _emit_json, _fail, _root, app, console, human_bytes
from .output import print_table


def duration_text(seconds: float | None) -> str:
    """Seconds as the unit a person reads: ``42 s``, ``53.0 min``, ``2.5 h``, ``3.1 d``."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if abs(seconds) >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.3g} s"


def _pairs(option: str, items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise StepvaultError(
                f"{option} {item!r}: write TIER=NUMBER, e.g. archive=0.7"
            ) from None
    return out


@app.command("plan")
def plan_cmd(
    run: Annotated[
        str | None, typer.Argument(help="Run whose measured costs to use; omit for a job.")
    ] = None,
    root: RootOpt = None,
    mtbf: Annotated[
        str | None, typer.Option(help="The job's mean time between failures: 24h, 7d, ...")
    ] = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes of the job (with --node-mtbf).")] = None,
    node_mtbf: Annotated[
        str | None, typer.Option(help="One node's MTBF, e.g. 5y (job MTBF = it / --nodes).")
    ] = None,
    save_cost: Annotated[
        str | None, typer.Option(help="What training waits per save (default: measured).")
    ] = None,
    write_time: Annotated[
        str | None, typer.Option(help="Save start to commit, for async saves (measured).")
    ] = None,
    restore_time: Annotated[str | None, typer.Option(help="Restore time (measured).")] = None,
    startup: Annotated[str, typer.Option(help="Start-up time after a failure.")] = "0",
    step_time: Annotated[str | None, typer.Option(help="Seconds per step (measured).")] = None,
    total_steps: Annotated[int | None, typer.Option(help="Planned length in steps.")] = None,
    duration: Annotated[
        str | None, typer.Option(help="Planned compute time, e.g. 30d (or --total-steps).")
    ] = None,
    steps_per_epoch: Annotated[int | None, typer.Option(help="For epoch rules.")] = None,
    save: Annotated[
        str | None, typer.Option(help="Current save policy, e.g. 'Every(steps=1000)'.")
    ] = None,
    keep: Annotated[
        str | None, typer.Option(help="Keep policy, e.g. 'KeepLast(3) | KeepEvery(steps=1000)'.")
    ] = None,
    tiers: Annotated[
        str | None,
        typer.Option(help="Tier policy, e.g. \"HotLast(3) | CopyEvery('archive', steps=5)\"."),
    ] = None,
    size: Annotated[
        str | None, typer.Option(help="Stored bytes per checkpoint, e.g. 14GB (measured).")
    ] = None,
    new_size: Annotated[
        str | None, typer.Option(help="New bytes each checkpoint adds (default: --size).")
    ] = None,
    price: Annotated[
        list[str] | None, typer.Option(help="TIER=PRICE, e.g. hot=0.10/GB-month (repeatable).")
    ] = None,
    size_factor: Annotated[
        list[str] | None,
        typer.Option(help="TIER=X: bytes in TIER per hot byte, e.g. archive=0.7 (codec)."),
    ] = None,
    trials: Annotated[int, typer.Option(help="Monte Carlo trials (0: no simulation).")] = 1000,
    seed: Annotated[int, typer.Option(help="Simulation seed.")] = 0,
    failures: Annotated[str, typer.Option(help="exponential or weibull.")] = "exponential",
    weibull_shape: Annotated[float | None, typer.Option(help="Weibull shape k.")] = None,
    plot: Annotated[
        str | None, typer.Option(help="Write a figure to FILE.png (needs stepvault[plot]).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """How often to save, what it costs and buys (ETTR, RPO, RTO), and the storage bill, from
    RUN's measured costs or the sizes given. See PLANNING.md."""
    from ..planning import plan as make_plan

    try:
        if failures == "weibull" and weibull_shape is None:
            raise StepvaultError("--failures weibull needs --weibull-shape K (e.g. 0.7)")
        if run is None and step_time is None and duration is None and total_steps is None:
            # The interval needs the save cost and the MTBF alone: answer that, say the rest.
            doc = interval_only(save_cost, mtbf, nodes, node_mtbf)
            if as_json:
                return _emit_json(doc)
            return _print_interval_only(doc)
        result = make_plan(
            _root(root) if run is not None else None,
            run,
            mtbf=mtbf,
            nodes=nodes,
            node_mtbf=node_mtbf,
            save_cost=save_cost,
            write_time=write_time,
            restore_time=restore_time,
            startup=startup,
            step_time=step_time,
            total_steps=total_steps,
            duration=duration,
            steps_per_epoch=steps_per_epoch,
            save=save,
            keep=keep,
            tiers=tiers,
            size=size,
            new_size=new_size,
            prices=price or None,
            size_factors=_pairs("--size-factor", size_factor or []),
            simulate_trials=trials,
            seed=seed,
            failures=failures,
            weibull_shape=weibull_shape,
        )
        if plot is not None:
            from ..planning.plot import plot_plan

            plot_plan(result, plot)
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(result.to_json())
    _print(result.to_json())
    if plot is not None:
        console.print(f"figure written to {plot}", highlight=False)
    return None


def _print(doc: dict[str, Any]) -> None:
    inputs = Table("input", "value", "source", title="inputs")
    for name, item in doc["inputs"].items():
        value = item["value"]
        if name.endswith("_seconds") and isinstance(value, (int, float)):
            value = duration_text(value)
        elif name == "sizes":
            value = ", ".join(
                f"{k}: {human_bytes(v['stored_bytes'])} stored, {human_bytes(v['new_bytes'])} new"
                for k, v in value.items()
            )
        inputs.add_row(name, str(value), item["source"])
    print_table(inputs)

    iv = doc["interval"]
    table = Table("interval", "compute between saves", "steps", title="checkpoint interval")
    table.add_row(
        "Young  sqrt(2CM)", duration_text(iv["young_seconds"]), f"{iv['young_steps']:.0f}"
    )
    table.add_row("Daly (2006)", duration_text(iv["daly_seconds"]), f"{iv['daly_steps']:.0f}")
    table.add_row("exact optimum", duration_text(iv["exact_seconds"]), "")
    if "current_seconds" in iv:
        steps = iv["current_steps"]
        table.add_row(
            "current policy",
            duration_text(iv["current_seconds"]),
            "-" if steps is None else f"{steps:.0f}",
        )
    print_table(table)

    rows = [g for g in (doc["goodput"]["optimum"], doc["goodput"]["current"]) if g]
    goodput = Table("", *(g["label"] for g in rows), title="goodput (expected over the run)")

    def simulated(g: dict[str, Any]) -> str:
        sim = g.get("simulated")
        if sim is None:
            return "-"
        return f"{sim['ettr']:.4f} ± {sim['ettr_se']:.4f} ({sim['relative_difference']:+.2%})"

    lines = [
        ("policy", lambda g: g["policy"]),
        ("saves", lambda g: str(g["saves"])),
        ("ETTR (useful / wall)", lambda g: f"{g['ettr']:.4f}"),
        (f"simulated ({(rows[0].get('simulated') or {}).get('distribution', '-')})", simulated),
        ("wall time", lambda g: duration_text(g["wall_seconds"])),
        ("in saves", lambda g: duration_text(g["save_seconds"])),
        ("in restarts", lambda g: duration_text(g["restart_seconds"])),
        ("lost work", lambda g: duration_text(g["lost_seconds"])),
        ("failures", lambda g: f"{g['failures']:.1f}"),
        (
            "RPO (worst lost work)",
            lambda g: f"{duration_text(g['rpo_seconds'])} ({g['rpo_steps']:.0f} steps)",
        ),
    ]
    for name, cell in lines:
        goodput.add_row(name, *(cell(g) for g in rows))
    print_table(goodput)
    console.print(
        f"RTO (expected time to ready after a failure): {duration_text(doc['rto_seconds'])}",
        highlight=False,
    )

    storage = doc["storage"]
    if storage is not None:
        table = Table(
            "tier",
            "checkpoints",
            "held at end",
            "peak",
            "moved in",
            "GB-months",
            "$/GB-month",
            "cost of run",
            "$/month after",
            title="storage over the run",
        )

        def money(v: float | None) -> str:
            return "?" if v is None else f"${v:,.2f}"

        for t in storage["tiers"].values():
            table.add_row(
                t["tier"],
                str(t["checkpoints_end"]),
                human_bytes(t["bytes_end"]),
                human_bytes(t["bytes_peak"]),
                human_bytes(t["bytes_moved_in"]),
                f"{t['gb_months']:.3g}",
                "?" if t["price_per_gb_month"] is None else f"{t['price_per_gb_month']:g}",
                money(t["cost_run"]),
                money(t["cost_per_month_after"]),
            )
        print_table(table)
    notes = doc["assumptions"] + ([] if storage is None else storage["assumptions"])
    for note in notes:
        console.print(f"[dim]assumed:[/] {note}", highlight=False)


def interval_only(
    save_cost: str | None, mtbf: str | None, nodes: int | None, node_mtbf: str | None
) -> dict[str, Any]:
    """The checkpoint interval from ``--save-cost`` and the MTBF alone (no run length, no
    step time): Young's, Daly's and the exact optimum in time, with the assumptions made."""
    from ..planning import interval as iv
    from ..planning.units import PlanError, parse_duration

    if save_cost is None:
        raise PlanError(
            "give --save-cost SECONDS (what training waits for per save), or a RUN whose "
            "saves were measured"
        )
    if mtbf is not None:
        m = parse_duration("--mtbf", mtbf)
        mtbf_source = "given"
    elif node_mtbf is not None and nodes is not None:
        if nodes < 1:
            raise PlanError(f"--nodes must be at least 1, got {nodes}")
        m = parse_duration("--node-mtbf", node_mtbf) / nodes
        mtbf_source = f"--node-mtbf / {nodes} nodes"
    else:
        raise PlanError("give --mtbf 24h (the job's), or --node-mtbf 5y with --nodes N")
    delta = parse_duration("--save-cost", save_cost)
    if delta <= 0 or m <= 0:
        raise PlanError("--save-cost and the MTBF must be positive durations")
    assumptions = [
        f"failures arrive at a constant rate (exponential) with MTBF {duration_text(m)}",
        f"each save stops training for {duration_text(delta)} (the whole --save-cost; for an "
        "async save give the stall only)",
        "the intervals are compute time between saves; they do not depend on the step time "
        "or the run's length",
        "for the interval in steps, goodput, RPO and the storage bill give --step-time and "
        "--duration (or --total-steps), or a RUN to measure",
    ]
    if delta >= 2 * m:
        assumptions.append(
            "the save cost is at least twice the MTBF: Daly's interval is the MTBF; "
            "checkpointing cannot keep up with these failures"
        )
    return {
        "inputs": {
            "save_cost_seconds": {"value": delta, "source": "given"},
            "mtbf_seconds": {"value": m, "source": mtbf_source},
        },
        "interval": {
            "young_seconds": iv.young_interval(delta, m),
            "daly_seconds": iv.daly_interval(delta, m),
            "exact_seconds": iv.exact_interval(delta, m),
        },
        "assumptions": assumptions,
    }


def _print_interval_only(doc: dict[str, Any]) -> None:
    iv = doc["interval"]
    console.print(
        f"save every {duration_text(iv['daly_seconds'])} of compute (Daly's interval)",
        highlight=False,
    )
    table = Table("interval", "compute between saves", title="checkpoint interval")
    table.add_row("Young  sqrt(2CM)", duration_text(iv["young_seconds"]))
    table.add_row("Daly (2006)", duration_text(iv["daly_seconds"]))
    table.add_row("exact optimum", duration_text(iv["exact_seconds"]))
    print_table(table)
    for note in doc["assumptions"]:
        console.print(f"[dim]assumed:[/] {note}", highlight=False)
