"""Operations on a store: verify, signatures, usage, gc, repair, export, import; metrics
attached after the fact (``annotate``), reader holds (``hold``) and checkpoint references
(``parse_ref``, ``resolve_ref``: ``RUN@latest`` is the newest full checkpoint)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

# Read-only operations (no torch) are imported at once; the rest on first use (PEP 562), so
# that ``stepvault du`` and ``stepvault verify`` start without importing torch. (verify and
# usage stay eager: their names are also submodule names, which a lazy lookup could return.)
from ..catalog.annotations import annotate
from ..catalog.reader_holds import hold
from ..catalog.refs import parse_ref, resolve_ref
from .signatures import SignatureReport, sign_existing, verify_signatures
from .usage import RunUsage, StoreUsage, store_usage, usage
from .verify import CheckpointReport, VerifyReport, verify, verify_store

_LAZY = {
    "ExportReport": ".export",
    "dequantize_int8": ".export",
    "export_weights": ".export",
    "quantize_int8": ".export",
    "GCResult": ".gc",
    "collect_garbage": ".gc",
    "import_dcp": ".migrate",
    "ImportReport": ".migrate",
    "import_checkpoint": ".migrate",
    "import_checkpoints": ".migrate",
    "RepairReport": ".repair",
    "repair_store": ".repair",
    "DiffReport": ".tensor_diff",
    "TensorDiff": ".tensor_diff",
    "diff": ".tensor_diff",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


if TYPE_CHECKING:
    from .export import ExportReport, dequantize_int8, export_weights, quantize_int8
    from .gc import GCResult, collect_garbage
    from .migrate import (
        ImportReport,
        import_checkpoint,
        import_checkpoints,
        import_dcp,
    )
    from .repair import RepairReport, repair_store
    from .tensor_diff import DiffReport, TensorDiff, diff

__all__ = [
    "CheckpointReport",
    "DiffReport",
    "ExportReport",
    "GCResult",
    "ImportReport",
    "RepairReport",
    "RunUsage",
    "SignatureReport",
    "StoreUsage",
    "TensorDiff",
    "VerifyReport",
    "annotate",
    "collect_garbage",
    "dequantize_int8",
    "diff",
    "export_weights",
    "hold",
    "import_checkpoint",
    "import_checkpoints",
    "import_dcp",
    "parse_ref",
    "quantize_int8",
    "repair_store",
    "resolve_ref",
    "sign_existing",
    "store_usage",
    "usage",
    "verify",
    "verify_signatures",
    "verify_store",
]
