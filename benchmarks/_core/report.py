"""The markdown section: results, machine, method and detail tables; and the same rows
printed on the terminal."""

from __future__ import annotations

import argparse
from typing import Any

from _common import (
    GB,
    MB,
    Gpt2Shape,
    Row,
    fmt_s,
    median,
    rows_table,
    section_head,
    table,
)

from .base import ASYNC_STALL_TARGET, DROP_CACHES
from .codecs import CodecRow
from .cold import COLD_LABELS, READERS, SEQ_BLOCK, ColdResults
from .restore import RestoreResults
from .save import SAVE_LABELS, SaveResults
from .stall import AsyncResults


def render(
    command: str,
    facts: dict[str, str],
    shape: Gpt2Shape,
    save: SaveResults,
    restore: RestoreResults,
    manager: AsyncResults,
    codecs: list[CodecRow],
    codec_source: str,
    rows: list[Row],
    args: argparse.Namespace,
    runtime: float,
) -> str:
    repeats, codec_repeats = args.repeats, args.codec_repeats
    out = [
        *section_head("Core benchmark", command, runtime, facts),
        "### Results",
        "",
        rows_table(rows),
        "",
    ]
    misses = [r for r in rows if r.verdict == "MISS"]
    if misses:
        out += ["Misses, with what the run measured:", ""]
        out += [f"- **{r.metric}**: {r.why or 'cause under investigation'}" for r in misses]
        out.append("")
    out += [
        "### Method",
        "",
        f"- State: {shape.describe()}; fp32 params (`randn * 0.02`, seed 0) plus AdamW-like "
        f"`exp_avg`/`exp_avg_sq` and a `step` scalar per parameter; "
        f"{save.logical_bytes / GB:.3f} GB logical, {len(shape.params())} parameters. "
        "Saved as `{'model': dict, 'optimizer': {'state': ..., 'param_groups': ...}}` "
        "(safetensors gets the same tensors flattened).",
        f"- Save: median of {repeats} repeats; before every timed write an untimed priming "
        "write of the same size into a scratch file that is deleted again (this VM is 2-5x "
        "slower writing into memory it has not touched for a few seconds), then `os.sync()`; "
        "each write "
        "includes fsync of the file (and its directory); stepvault writes into a fresh store "
        "every repeat, so nothing deduplicates; outputs are deleted after each write. GB = 1e9 "
        "bytes of logical tensor data. The disk limit writes the same tensor bytes with large "
        "sequential `os.write` calls into one file. Writer order per repeat: "
        + "; ".join(" → ".join(o) for o in save.orders)
        + ".",
        "- Second save: same store, step 2, same state, right after the first (raw) save.",
        f"- Restore: median of {args.restore_repeats} repeats into pre-faulted destination "
        "tensors (a flat `{name: tensor}` state, which stepvault restores in place via "
        "`CheckpointReader.read_into`); the files were just written, so reads come from the "
        "page cache (warm). safetensors = "
        "`load_file` + `copy_`; both verified bit-exact on the first repeat; the order "
        "alternates; freeing what a load allocated/mapped is inside its time (cyclic garbage "
        "too: a full gc after the call, minus the cost of a gc with nothing to free). After each "
        "pair a plain `copy_` of the in-memory state into the same destination is timed as a "
        "reference for the machine's memory speed at that moment. Stage rows come from extra "
        "public `stepvault.restore` calls with the read path's functions wrapped by timers "
        "(exclusive main-thread wall time, page faults); two diagnostic rows: the same restore "
        "with the reader's `decode_object` patched to `verify=False`, and `content_hash` "
        "(BLAKE3) over the same bytes in memory.",
        cold_method(restore.cold, args),
        f"- CheckpointManager: the same tensors (shared storage) as top-level entries "
        "`{'model': nn.Module of nn.Parameters, 'optimizer': {'state': ..., 'param_groups': "
        "...}}`. Synchronous: `CheckpointManager(store, run, async_save=False).save()` into a "
        f"fresh store, wall time of the call, median of {args.async_repeats}. Asynchronous: "
        f"{args.async_repeats} fresh managers (`async_save=True`, fresh store each), "
        f"{manager.saves_per_manager} saves each; the stall is `handle.stall_seconds` (the "
        "training thread's time in `save()`). Each manager first calls `mgr.restore(state)` "
        "(a fresh start), which prepares the staging buffers on a background thread; the "
        "benchmark waits for `stats()['staging_ready']` (time reported: the training steps "
        "before a first save would hide it), then saves: the ≤ "
        f"{ASYNC_STALL_TARGET} target applies to the first save and to the later ones, and "
        "so does the ≤ 1.3x target against a bare copy of the state into pre-faulted memory "
        "timed right before each save. A third kind of manager saves at once after "
        "construction (before any preparation could finish): that save is written "
        "synchronously, and its wall time is compared with the synchronous save. Before every save "
        "(both kinds) all tensors get `add_(1)` in place, so every async write is real "
        "(new bytes each time), then the priming write and `os.sync()` as for the save rows; "
        "each async save is waited for (`handle.result()`) before the next, so the background "
        "write runs alone here (in training it shares the 2 cores with the training step). "
        "Both kinds save the same logical bytes (checked). Staging memory: "
        "`mgr.stats()['staging_bytes']`; RSS growth from VmRSS before the manager was created "
        "(max while open, and after `close()`). Right before each save a plain "
        "`copy_` of the state into a pre-faulted buffer of the same size is timed as a "
        "reference for the machine's memory speed then. Order per repeat: "
        + "; ".join(" → ".join(o) for o in manager.orders)
        + ". The stall split comes from the same saves, with `take_snapshot`, `new_manifest` "
        "and `StagingArea.stage` wrapped by timers.",
        f"- Codecs: {codec_source}, all float tensors flattened into one fp32 buffer "
        f"({codecs[0].nbytes / MB:.1f} MB) and its bf16 cast ({codecs[1].nbytes / MB:.1f} MB); "
        f"one call per codec on the whole buffer, single thread, median of {codec_repeats}. "
        "zipnn gets a fresh copy of its input every repeat (it rewrites its input buffer).",
        "",
        "### Details",
        "",
        table(
            ["save writer", "median", "GB/s", "all repeats (s)", "stored / logical"],
            [
                [
                    SAVE_LABELS[k],
                    fmt_s(median(v)),
                    f"{save.gbps(k):.2f}",
                    ", ".join(f"{x:.2f}" for x in v),
                    f"{median([float(s) for s in save.stored[k]]) / save.logical_bytes:.3f}",
                ]
                for k, v in save.times.items()
            ]
            + [
                [
                    "stepvault second unchanged save",
                    fmt_s(median(save.second_times)),
                    f"{save.logical_bytes / GB / median(save.second_times):.2f}",
                    ", ".join(f"{x:.2f}" for x in save.second_times),
                    f"new {int(median(save.second_new))} B",
                ]
            ],
        ),
        "",
        table(
            ["restore", "median", "all repeats (s)", "page faults (median)"],
            [
                [
                    k,
                    fmt_s(median(v)),
                    ", ".join(f"{x:.2f}" for x in v),
                    f"{int(median([float(x) for x in restore.faults[k]]))}",
                ]
                for k, v in restore.times.items()
            ]
            + [
                [
                    "reference: in-memory copy_ of the state",
                    fmt_s(median(restore.reference)),
                    ", ".join(f"{x:.2f}" for x in restore.reference),
                    "",
                ],
                [
                    "stepvault / safetensors, per repeat",
                    f"{median(restore.paired_ratios()):.2f}",
                    ", ".join(f"{x:.2f}" for x in restore.paired_ratios()),
                    "",
                ],
            ],
        ),
        "",
        table(
            [
                f"restore stage ({len(next(iter(restore.stages.values()), []))} extra runs)",
                "median s",
                "all runs (s)",
                "page faults (median)",
            ],
            [
                [
                    k,
                    f"{median(v):.3f}",
                    ", ".join(f"{x:.2f}" for x in v),
                    f"{int(median([float(x) for x in restore.stage_faults[k]]))}",
                ]
                for k, v in restore.stages.items()
            ],
        ),
        "",
        *cold_details(restore.cold),
        async_details(manager),
        "",
        table(
            ["codec", "dtype", "ratio", "encode MB/s", "decode MB/s"],
            [
                [name, c.dtype, f"{c.ratio[name]:.3f}", f"{c.enc[name]:.0f}", f"{c.dec[name]:.0f}"]
                for c in codecs
                for name in c.ratio
            ],
        ),
        "",
        table(
            ["float codec stage (same loop, median)", "dtype", "seconds", "share"],
            [
                [
                    k,
                    c.dtype,
                    f"{v:.3f}",
                    f"{v / c.breakdown[k.split(':')[0] + ': whole (same loop)']:.0%}",
                ]
                for c in codecs
                for k, v in c.breakdown.items()
            ],
        ),
        "",
    ]
    return "\n".join(out)


def codec_json(codecs: list[CodecRow]) -> list[dict[str, Any]]:
    return [
        {"dtype": c.dtype, "ratio": c.ratio, "enc": c.enc, "dec": c.dec, "breakdown": c.breakdown}
        for c in codecs
    ]


def cold_method(cold: ColdResults | None, args: argparse.Namespace) -> str:
    if cold is None or cold.skipped is not None:
        return f"- Cold restore: skipped ({'not run' if cold is None else cold.skipped})."
    return (
        f"- Cold restore: median of {args.cold_repeats} repeats of each of stepvault, "
        "safetensors and two sequential reads of the safetensors file; before each, this "
        f"process runs `os.sync()` and writes `3` to {DROP_CACHES} (file closed), then starts "
        "a fresh child process (this script with a hidden option) that imports everything, "
        "restores a tiny checkpoint of each kind untimed (libraries, thread pools), allocates "
        "and pre-faults the destination tensors, records how much of the files is still in "
        "the page cache (mincore; the `cached before` column), touches and frees as much "
        "memory as the files' size (untimed, like the save rows' priming write), and then "
        "times only the load into the destination (plus freeing and cyclic garbage, as warm) "
        "and the CPU time all its threads used meanwhile. The sequential reads use "
        f"{SEQ_BLOCK >> 20} MiB `pread()` calls into pre-faulted buffers: one reader over the "
        f"whole file (like `dd bs=16M`), and {READERS} readers in parallel, each over one "
        "contiguous part. The sanity check compares the cold safetensors time with the faster "
        "of the two. Both the priming and the parallel read come from checking that "
        "safetensors was not faster than reading its file, which it was at first (4 runs "
        "each on a quiet machine while this benchmark was developed): without the priming a "
        "single reader took 2.2 s (2.2-3.0) against 1.35 s for safetensors (the same with or "
        "without priming). This VM hands memory that stays free for a few seconds back to its "
        "host (virtio-balloon free page reporting; DAMON is active too); drop_caches frees the "
        "page cache and a child's start-up takes seconds, so the read refilled the page cache "
        "with memory the host had to back again. With the priming one reader took 1.2 s "
        "(0.9-1.8), still not reliably below safetensors: on this VM a reader is CPU-bound "
        "in the kernel (`dd bs=16M` used 0.8-3.3 s of system time in 1.5-3.8 s), whereas "
        "torch's copy_ faults the mapped file in from both cores; two parallel readers took "
        "0.8 s (0.65-1.0). "
        "Restored data is checked against a fingerprint of the state. The stepvault stage "
        "split comes from the timed runs themselves (read-path functions wrapped). Order per "
        "repeat: " + "; ".join(" → ".join(o) for o in cold.orders) + ". The VM's virtual disk "
        "may be cached by its host; dropping the guest's page cache does not drop that."
    )


def cold_details(cold: ColdResults | None) -> list[str]:
    if cold is None or cold.skipped is not None:
        return []
    body = [
        [
            COLD_LABELS[k],
            fmt_s(median(v)),
            f"{cold.file_bytes[k] / GB / median(v):.2f}",
            ", ".join(f"{x:.2f}" for x in v),
            ", ".join(f"{x:.1%}" for x in cold.resident[k]),
            f"{int(median([float(x) for x in cold.faults[k]]))}",
            f"{median(cold.cpu[k]):.2f}",
        ]
        for k, v in cold.times.items()
    ]
    body.append(
        [
            "stepvault / safetensors, per repeat",
            f"{median(cold.paired_ratios()):.2f}",
            "",
            ", ".join(f"{x:.2f}" for x in cold.paired_ratios()),
            "",
            "",
            "",
        ]
    )
    out = [
        table(
            [
                "cold restore (fresh process)",
                "median",
                "GB/s of files",
                "all repeats (s)",
                "cached before",
                "page faults (median)",
                "CPU s, all threads (median)",
            ],
            body,
        ),
        "",
    ]
    if cold.stages:
        out += [
            table(
                ["cold stepvault restore stage (same runs)", "median s", "all runs (s)"],
                [
                    [k, f"{median(v):.3f}", ", ".join(f"{x:.2f}" for x in v)]
                    for k, v in cold.stages.items()
                ],
            ),
            "",
        ]
    return out


def async_details(m: AsyncResults) -> str:
    def line(label: str, xs: list[float], digits: int = 3) -> list[str]:
        return [label, f"{median(xs):.{digits}f}", ", ".join(f"{x:.{digits}f}" for x in xs)]

    body = [
        line("synchronous save: wall of mgr.save()", m.sync_times, 2),
        line("async first save: handle.stall_seconds", m.first),
        line("async first save: wall of mgr.save()", m.first_wall),
        line("async later saves: handle.stall_seconds", m.later),
        line("async later saves: wall of mgr.save()", m.later_wall),
        line("reference: plain copy_ of the state right before each later save", m.reference),
        line("async first save: background write (SaveInfo.seconds)", m.first_write, 2),
        line("async later saves: background write (SaveInfo.seconds)", m.later_write, 2),
        line("async later saves: new bytes (GB)", [x / GB for x in m.later_new], 2),
        line("async first save: page faults during save()", [float(x) for x in m.first_faults], 0),
        line("async later saves: page faults during save()", [float(x) for x in m.later_faults], 0),
        line("staging_bytes (GB)", [x / GB for x in m.staging], 2),
        line("RSS growth while the manager is open (GB)", [x / GB for x in m.rss_open], 2),
        line("RSS growth after close() (GB)", [x / GB for x in m.rss_closed], 2),
    ]
    body += [line(f"first save stall: {k}", v) for k, v in m.first_split.items()]
    body += [line(f"later save stall: {k}", v) for k, v in m.later_split.items()]
    return table(["CheckpointManager save", "median (s unless noted)", "all runs"], body)


def print_results(rows: list[Row]) -> None:
    """The results table on the terminal, then one line per miss with its measured cause."""
    print(rows_table(rows))
    for r in rows:
        if r.verdict == "MISS":
            print(f"MISS {r.metric}: {r.why or 'cause under investigation'}")
