"""Operations on a whole store: verify, signatures, usage, gc, repair, export, import."""

from .export import ExportReport, dequantize_int8, export_weights, quantize_int8
from .gc import GCResult, collect_garbage
from .importing import UntrustedInputError, import_dcp
from .migrate import ImportReport, import_checkpoint, import_checkpoints
from .repair import RepairReport, repair_store
from .signatures import SignatureReport, sign_existing, verify_signatures
from .usage import RunUsage, StoreUsage, store_usage, usage
from .verify import CheckpointReport, VerifyReport, verify, verify_store

__all__ = [
    "CheckpointReport",
    "ExportReport",
    "GCResult",
    "ImportReport",
    "RepairReport",
    "RunUsage",
    "SignatureReport",
    "StoreUsage",
    "UntrustedInputError",
    "VerifyReport",
    "collect_garbage",
    "dequantize_int8",
    "export_weights",
    "import_checkpoint",
    "import_checkpoints",
    "import_dcp",
    "quantize_int8",
    "repair_store",
    "sign_existing",
    "store_usage",
    "usage",
    "verify",
    "verify_signatures",
    "verify_store",
]
