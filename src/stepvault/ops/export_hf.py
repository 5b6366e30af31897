"""Deployable exports: a checkpoint becomes a model folder that its framework loads as is.

``format="hf"`` (the default when the checkpoint carries a ``config.json`` attachment)
writes what ``transformers``' ``save_pretrained`` would: ``config.json`` (its ``dtype``
set to the exported weights' dtype), the weights as safetensors (sharded with
``model.safetensors.index.json`` above ``max_shard_size``), tied weights left out the way
transformers does (the tied copy is rebuilt by ``from_pretrained``), every other attachment
(tokenizer files, ``generation_config.json``...), and a ``README.md`` model card with the
checkpoint's provenance. ``format="folder"`` is the same without the transformers
specifics (e.g. a Lightning module: weights + ``hparams.json``). Both add
``stepvault-export.json``: the source checkpoint and the BLAKE3 of every file, which
:func:`verify_export` checks (and the registry records).

The folder is assembled in a temporary sibling directory and renamed into place, so a
failed export never leaves a half-written model where a server would look for one.

(Longer than most modules: one exporter — choosing the format, writing the folder, its
model card and manifest, and verify-export reading that manifest back.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from .._version import __version__
from ..catalog.annotations import manifest_id, merged_metrics, read_annotations
from ..catalog.attachments import Attachment, checkpoint_attachments
from ..catalog.events import log_event
from ..catalog.lineage import read_lineage
from ..catalog.reader_holds import holding
from ..catalog.vault import Vault
from ..errors import ExportError, StepvaultError
from ..store import Store
from .export import ExportReport, _export, export_weights, weight_tensors

MODEL_CONFIG = "config.json"
MODEL_CARD = "README.md"
EXPORT_RECORD = "stepvault-export.json"
EXPORT_FORMAT = "stepvault-export"
FORMATS = ("hf", "folder", "safetensors")


@dataclass
class FolderExport:
    """What :func:`export_folder` wrote."""

    out: str
    format: str
    run: str
    step: int
    manifest_blake3: str
    files: list[dict[str, Any]] = field(default_factory=list)  # {"path", "blake3", "size"}
    tensors: int = 0
    total_bytes: int = 0
    cast: str | None = None
    dtype: str | None = None
    quantization: dict[str, Any] | None = None
    #: tied weights left out (``name -> the weight it is tied to``)
    tied: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def file_blake3(path: str | os.PathLike[str]) -> str:
    """BLAKE3 of a file's bytes (streamed)."""
    h = blake3(max_threads=blake3.AUTO)
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def resolve_format(
    store: Store, run: str, step: int | str | None, out: str | os.PathLike[str], fmt: str | None
) -> str:
    """``fmt`` checked, or the default: ``hf`` with a model config attached, ``folder``
    with other attachments, else ``safetensors`` (weights only, as before attachments)."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ExportError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
        return fmt
    if os.fspath(out).endswith(".safetensors"):
        return "safetensors"
    m = Vault(store).checkpoint(run, step).manifest
    attachments = checkpoint_attachments(store, m.run, m.step)
    if MODEL_CONFIG in attachments:
        return "hf"
    return "folder" if attachments else "safetensors"


def export_checkpoint(
    store: Store,
    run: str,
    step: int | str | None,
    out: str | os.PathLike[str],
    *,
    format: str | None = None,
    **options: Any,
) -> ExportReport | FolderExport:
    """Export ``run@step`` in ``format`` (see :func:`resolve_format`); one entry point for
    ``stepvault export``, ``register --export`` and ``promote --export``. A checkpoint in
    any tier of ``store`` is exported (read as restore reads it, hot first)."""
    from ..tiers.view import read_view

    store = read_view(store)
    config = options.pop("config", None)
    if format is None and config is not None:
        format = "hf"  # a config given is a from_pretrained folder asked for
    fmt = resolve_format(store, run, step, out, format)
    if fmt != "hf" and config is not None:
        raise ExportError(f"config= makes an HF folder; it does not apply to format {fmt!r}")
    if fmt == "safetensors":
        return export_weights(store, run, step, out, **options)
    return export_folder(store, run, step, out, hf=fmt == "hf", config=config, **options)


def _tied_weights(
    config: dict[str, Any],
    vault: Vault,
    run: str,
    step: int,
    module: str | None,
    strip_prefix: str | None = None,
):
    """Weights to leave out because ``from_pretrained`` re-ties them: the targets of the
    model class's ``_tied_weights_keys`` whose content equals their source's (names as
    exported: ``strip_prefix`` removed)."""
    if not config.get("tie_word_embeddings", True):
        return {}
    try:
        import transformers
    except ImportError:  # without transformers nothing is known about ties: keep every weight
        return {}
    declared: dict[str, str | None] = {}
    for arch in config.get("architectures") or []:
        # Only a class that transformers itself exports by that name; nothing is imported
        # or executed from the checkpoint.
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        keys = getattr(cls, "_tied_weights_keys", None) or {}
        if isinstance(keys, dict):
            declared.update(keys)
        else:  # transformers 4.x: a list of targets
            declared.update(dict.fromkeys(keys))
    if not declared:
        return {}
    loaders = {}
    for name, load in weight_tensors(vault, run, step, module):
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        loaders[name] = load
    tied: dict[str, str] = {}
    for target, source in declared.items():
        if target not in loaders:
            continue
        candidates = [source] if source else [n for n in loaders if n != target]
        t = loaders[target]()
        for name in candidates:
            if name in loaders and name not in tied:
                s = loaders[name]()
                if s.dtype == t.dtype and s.shape == t.shape and bool((s == t).all()):
                    tied[target] = name
                    break
    return tied


def _set_dtype(config: dict[str, Any], dtype: str | None) -> None:
    """Record the weights' dtype under the key the config's transformers version uses."""
    if dtype is None:
        return
    major = str(config.get("transformers_version", "5")).split(".")[0]
    old = "torch_dtype" in config or (major.isdigit() and int(major) < 5)
    key = "torch_dtype" if old else "dtype"  # transformers 5 renamed torch_dtype to dtype
    config.pop("dtype" if key == "torch_dtype" else "torch_dtype", None)
    config[key] = dtype


def _provenance(store: Store, run: str, step: int, data: bytes) -> dict[str, Any]:
    m = Vault(store).manifest(run, step)
    metrics = merged_metrics(
        m.metrics, read_annotations(store, run).get(step, []), manifest_id(data)
    )
    lineage: dict[str, Any] = {}
    if m.lineage:
        try:
            lineage = read_lineage(store, run, m.lineage)
        except StepvaultError as exc:
            lineage = {"error": str(exc)}
    code = lineage.get("code") or {}
    return {
        "run": run,
        "step": step,
        "epoch": m.epoch,
        "created": m.created,
        "metrics": metrics,
        "manifest_blake3": manifest_id(data),
        "store": store.backend.url,
        "data": lineage.get("data"),
        "code_commit": code.get("git_commit"),
        "code_dirty": code.get("dirty"),
        "lineage": m.lineage,
        "stepvault_version": __version__,
    }


def _model_card(existing: bytes | None, prov: dict[str, Any], report: FolderExport) -> bytes:
    """A model card naming where the weights come from (appended to an attached card)."""
    q = report.quantization
    lines = [
        "## Provenance (stepvault)",
        "",
        "| | |",
        "|---|---|",
        f"| checkpoint | `{prov['run']}@{prov['step']}` (epoch {prov['epoch']}) |",
        f"| manifest BLAKE3 | `{prov['manifest_blake3']}` |",
        f"| store | `{prov['store']}` |",
        f"| metrics | {', '.join(f'{k}={v:.6g}' for k, v in prov['metrics'].items()) or '-'} |",
        f"| data fingerprint | `{json.dumps(prov['data'], sort_keys=True)}` |",
        f"| code commit | `{prov['code_commit']}`{' (dirty)' if prov['code_dirty'] else ''} |",
        f"| weights dtype | {report.dtype} |",
        f"| tied weights left out | {', '.join(report.tied) or '-'} |",
        f"| exported by | stepvault {prov['stepvault_version']} |",
        "",
    ]
    if q:
        lines += [
            f"**LOSSY export**: {q['scheme']}, {q['tensors']} tensors quantized, relative "
            f"error max {q['max_rel_error']:.3g}. The int8 weights and their `.scale` tensors "
            "are not loadable by `from_pretrained` as is; dequantize with "
            "`stepvault.ops.export.dequantize_int8`.",
            "",
        ]
    lines.append(f"File hashes: `{EXPORT_RECORD}` (check with `stepvault verify-export DIR`).")
    if existing:
        return existing.rstrip(b"\n") + b"\n\n" + "\n".join(lines).encode() + b"\n"
    front = ["---", "library_name: transformers", "tags:", "- stepvault", "---", ""]
    if report.format != "hf":
        front = ["---", "tags:", "- stepvault", "---", ""]
    title = [f"# {prov['run']} @ step {prov['step']}", ""]
    return "\n".join(front + title + lines).encode() + b"\n"


def _stored_float_dtype(m: Any) -> str | None:
    """The first floating dtype among the modules' stored tensors (from the manifest only:
    an optimizer's float32 moments must not decide the dtype of bfloat16 weights)."""
    modules = tuple(k + "/" for k, v in m.state_kinds.items() if v == "module")
    dtypes = [t.dtype for n, t in m.tensors.items() if n.startswith(modules)]
    if m.sharded:
        dtypes += [e["dtype"] for e in m.sharded["entries"].values() if e["type"] == "tensor"]
    return next((d for d in dtypes if d.startswith(("float", "bfloat"))), None)


def export_folder(
    store: Store,
    run: str,
    step: int | str | None,
    out: str | os.PathLike[str],
    *,
    hf: bool = True,
    module: str | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    quantize: str | None = None,
    include: str | None = None,
    strip_prefix: str | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    config: Any = None,
) -> FolderExport:
    """Write ``run@step`` as a model folder at ``out`` (see the module docstring).

    ``out`` must be absent, empty, or an earlier stepvault export (replaced as a whole).
    ``config``: the model's config where the checkpoint has no ``config.json`` attached
    (a plain DeepSpeed job, a LightningModule holding a transformers model): the path of a
    ``config.json`` (or of a folder holding one), a dict, a transformers config, or the
    live model: a ``PreTrainedModel``, or any module holding one (its config, with
    ``architectures`` set to its class; unless ``strip_prefix`` is given, only the weights
    under its path in the module are exported, with that prefix stripped).
    """
    vault = Vault(store)
    m = vault.checkpoint(run, step).manifest
    run, step = m.run, m.step
    data = store.read_manifest(run, step)
    attachments = checkpoint_attachments(store, run, step, data)
    given = None
    if config is not None:
        given, prefix = model_config(config)
        if strip_prefix is None and prefix:
            # the transformers model inside a module: only its weights, under its names
            strip_prefix = prefix
            include = include or "^" + re.escape(prefix)
    if hf and given is None and MODEL_CONFIG not in attachments:
        raise ExportError(
            f"{run}@{step} has no '{MODEL_CONFIG}' attachment, which an HF export needs "
            f"(attachments: {', '.join(attachments) or 'none'}). Attach the model's config: "
            f"model.config.save_pretrained(DIR), then 'stepvault attach {run}@{step} "
            f"DIR/{MODEL_CONFIG}'; or export the weights alone with --format safetensors"
        )
    config = (given or _json_attachment(attachments[MODEL_CONFIG])) if hf else None
    out = os.path.abspath(os.fspath(out))
    _check_target(out)
    tied = _tied_weights(config, vault, run, step, module, strip_prefix) if config else {}
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.stepvault-", dir=parent)
    try:
        with holding(store, run, step, owner="export"):  # no GC takes it mid-export
            weights = _export(
                store,
                run,
                step,
                tmp,
                module=module,
                dtype=dtype,
                include=include,
                strip_prefix=strip_prefix,
                max_shard_size=max_shard_size,
                quantize=quantize,
                exclude=frozenset(tied),
                progress=progress,
            )
        report = FolderExport(
            out=out,
            format="hf" if hf else "folder",
            run=run,
            step=step,
            manifest_blake3=manifest_id(data),
            tensors=weights.tensors,
            total_bytes=weights.total_bytes,
            cast=dtype,
            dtype=dtype or _stored_float_dtype(m),
            quantization=weights.quantization,
            tied=tied,
        )
        for name, att in attachments.items():
            if name in (MODEL_CONFIG, MODEL_CARD, EXPORT_RECORD) and (hf or name != MODEL_CONFIG):
                continue
            _write(tmp, name, att.read())
        if config is not None:
            _set_dtype(config, "float32" if quantize else report.dtype)
            if report.quantization:
                config["stepvault_quantization"] = {
                    k: v for k, v in report.quantization.items() if k != "per_tensor"
                }
            _write(
                tmp, MODEL_CONFIG, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
            )
        card = attachments[MODEL_CARD].read() if MODEL_CARD in attachments else None
        _write(tmp, MODEL_CARD, _model_card(card, _provenance(store, run, step, data), report))
        for name in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, name)
            report.files.append(
                {"path": name, "blake3": file_blake3(path), "size": os.path.getsize(path)}
            )
        record = {
            "format": EXPORT_FORMAT,
            "version": 1,
            "source": {"run": run, "step": step, "manifest_blake3": report.manifest_blake3},
            "export_format": report.format,
            "options": {"dtype": dtype, "quantize": quantize, "max_shard_size": max_shard_size},
            "files": report.files,
        }
        _write(tmp, EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    q = report.quantization or {}
    log_event(
        store,
        run,
        "export",
        step=step,
        output=out,
        format=report.format,
        tensors=report.tensors,
        bytes=report.total_bytes,
        cast=dtype,
        quantize=quantize,
        max_rel_error=q.get("max_rel_error"),
    )
    return report


def model_config(config: Any) -> tuple[dict[str, Any], str | None]:
    """``config=`` of :func:`export_folder` as ``(config.json's dict, strip prefix)``."""
    if isinstance(config, Mapping):
        return dict(config), None
    if isinstance(config, str | os.PathLike):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, MODEL_CONFIG)
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            raise ExportError(
                f"config {path}: no such file; pass a config.json or the folder of one "
                "(model.config.save_pretrained(DIR) writes it)"
            ) from None
        except ValueError as exc:
            raise ExportError(f"config {path} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ExportError(f"config {path} must hold a JSON object")
        return doc, None
    prefix = None
    if hasattr(config, "named_modules") and not hasattr(config, "config"):
        # a module holding a transformers model (a LightningModule): the outermost one
        found = [(n, m) for n, m in config.named_modules() if _is_pretrained(m)]
        if not found:
            raise ExportError(
                f"{type(config).__name__} holds no transformers PreTrainedModel; pass its "
                "config.json (config=PATH, CLI --config) instead"
            )
        path, config = found[0]
        prefix = f"{path}." if path else None
    if _is_pretrained(config):
        model, config = config, config.config
        doc = _config_doc(config)
        doc.setdefault("architectures", None)
        doc["architectures"] = doc["architectures"] or [type(model).__name__]
        return doc, prefix
    return _config_doc(config), prefix


def _is_pretrained(obj: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # without transformers no module is one
        return False
    return isinstance(obj, PreTrainedModel)


def _config_doc(config: Any) -> dict[str, Any]:
    """A transformers config as config.json's dict (all values, as save_pretrained)."""
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        raise ExportError(
            f"config must be a path, a dict, a transformers config or model, not "
            f"{type(config).__name__}"
        )
    doc = json.loads(to_json(use_diff=False))
    if not isinstance(doc, dict):  # pragma: no cover - transformers writes an object
        raise ExportError(f"{type(config).__name__}.to_json_string() is not a JSON object")
    return doc


def _json_attachment(att: Attachment) -> dict[str, Any]:
    try:
        doc = json.loads(att.read())
    except ValueError as exc:
        raise ExportError(f"attachment {att.name!r} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ExportError(f"attachment {att.name!r} must hold a JSON object")
    return doc


def _write(folder: str, name: str, data: bytes) -> None:
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def _check_target(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{out} exists and is not a folder; choose another --output")
    if (
        os.path.isdir(out)
        and os.listdir(out)
        and not os.path.exists(os.path.join(out, EXPORT_RECORD))
    ):
        raise ExportError(
            f"{out} is not empty and not an earlier stepvault export; choose another --output "
            "or empty it (an export replaces the whole folder)"
        )


def _publish(tmp: str, out: str) -> None:
    """Rename the assembled folder into place (an earlier export is replaced whole)."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model folder is read by servers
    old = None
    if os.path.isdir(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "x"))
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class ExportCheck:
    """Result of :func:`verify_export`."""

    folder: str
    ok: bool
    checked: int
    problems: list[str]
    source: dict[str, Any] | None
    anchored: bool  # checked against the registry's record, not only the folder's own

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def verify_export(
    folder: str | os.PathLike[str], expected: list[dict[str, Any]] | None = None
) -> ExportCheck:
    """Re-hash every file of an exported folder against its ``stepvault-export.json``.

    With ``expected`` (the file list a registry version recorded) the folder's record must
    match it too, so an edit that also rewrote ``stepvault-export.json`` is caught.
    """
    folder = os.fspath(folder)
    problems: list[str] = []
    try:
        with open(os.path.join(folder, EXPORT_RECORD), "rb") as f:
            record = json.load(f)
        files = record["files"]
        source = record.get("source")
    except FileNotFoundError:
        raise ExportError(
            f"{folder} has no {EXPORT_RECORD}: not a stepvault export folder (or it lost that "
            "file); re-export it with 'stepvault export RUN@STEP -o DIR'"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{folder}/{EXPORT_RECORD} is damaged: {exc!r}") from None
    if expected is not None:
        want = {(e.get("name") or os.path.basename(e["path"])): e["blake3"] for e in expected}
        have = {e["path"]: e["blake3"] for e in files}
        listed_want = {n: h for n, h in want.items() if n != EXPORT_RECORD}
        if listed_want != have:
            changed = sorted(n for n in {*listed_want, *have} if listed_want.get(n) != have.get(n))
            problems.append(f"{EXPORT_RECORD} differs from the registry's record: {changed}")
        files = [{"path": n, "blake3": h} for n, h in want.items()]
    listed = {e["path"] for e in files}
    for e in files:
        name = e["path"]
        if os.path.basename(name) != name or name in ("", ".", ".."):
            problems.append(f"{name!r}: not a plain file name")
            continue
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{name}: missing")
        elif file_blake3(path) != e["blake3"]:
            problems.append(f"{name}: content changed (BLAKE3 differs from the export record)")
    for name in sorted(os.listdir(folder)):
        if name not in listed and name != EXPORT_RECORD:
            problems.append(f"{name}: not part of the export (added later)")
    return ExportCheck(folder, not problems, len(files), problems, source, expected is not None)
