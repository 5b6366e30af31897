"""The safe object encoding: typed JSON for everything in a state that is not a tensor.

No pickle, ever. A value either maps to one of the forms below or is refused *at save
time* with its key path and type. Decoding only builds these types (plus converters the
*reading* program registered itself), so loading a checkpoint cannot run stored code.

=====================  ===========================================================
Python value           JSON form
=====================  ===========================================================
None, bool, str        null, true/false, string
int                    number; ``{"$int": "<decimal>"}`` when ``|n| >= 2**53``
float                  number (shortest repr, ``-0.0`` kept); ``{"$float": "nan"|"inf"|"-inf"}``
bytes / bytearray      ``{"$bytes": "<base64>"}``
list / tuple           array / ``{"$tuple": [...]}``
dict                   object when every key is a str not starting with ``$``,
                       else ``{"$dict": [[key, value], ...]}`` (str or int keys)
torch.Tensor           ``{"$tensor": "<name>"}`` — bytes go through the chunk path
numpy.ndarray          ``{"$ndarray": "<name>"}`` — idem
(embedded array)       ``{"$array": ["torch"|"numpy", "<dtype>", [shape], "<base64>"]}``
numpy scalar           ``{"$npscalar": ["<dtype>", "<little-endian bytes as hex>"]}``
torch.dtype/Size/device ``{"$dtype": "bfloat16"}``, ``{"$size": [2, 3]}``, ``{"$device": "cpu"}``
registered type        ``{"$ext": ["<name>", <encoded value>]}``
=====================  ===========================================================

(Longer than most modules on purpose: the encoder and decoder of one specification,
FORMAT.md §5, read side by side.)
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ManifestError, UnsupportedTypeError
from .dtypes import dtype_from_numpy, dtype_info

if TYPE_CHECKING:
    import torch

# torch is imported only when a torch value is encoded or decoded: reading manifests
# (``stepvault ls``, ``show``) goes through this module and must not pay for importing torch.
# Encoding needs no import at all: a value can only be a torch object once torch is loaded.

_SAFE_INT = 2**53
#: Most decimal digits an ``$int`` may have (CPython's default int/str conversion limit).
_MAX_INT_DIGITS = 4300
_DTYPE_NAMES = [
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]


def _torch() -> Any:
    import torch

    return torch


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    torch = _torch()
    return {name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)}


@cache
def _torch_dtype_names() -> dict[torch.dtype, str]:
    return {v: k for k, v in _torch_dtypes().items()}


@dataclass(frozen=True)
class _Converter:
    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


_BY_TYPE: dict[type, _Converter] = {}
_BY_NAME: dict[str, _Converter] = {}


def register_type(
    cls: type, name: str, encode: Callable[[Any], Any], decode: Callable[[Any], Any]
) -> None:
    """Teach the encoding a new type, by converting it to and from encodable values.

    ``encode(obj)`` must return a value the safe encoding accepts (dict, list, str, tensor...);
    ``decode(value)`` rebuilds the object. ``name`` is stored in the checkpoint, so keep it
    stable (e.g. ``"mylib.Config"``). Readers must register the same name to load it; the
    stored data is never used to pick code beyond this lookup.

    Example::

        stepvault.state.register_type(Fraction, "fractions.Fraction",
                                encode=lambda f: [f.numerator, f.denominator],
                                decode=lambda v: Fraction(*v))
    """
    if not isinstance(name, str) or not name:
        raise ValueError("converter name must be a non-empty str")
    conv = _Converter(cls, name, encode, decode)
    # Re-registering replaces both directions, so no stale class or name lingers.
    unregister_type(cls)
    old = _BY_NAME.pop(name, None)
    if old is not None:
        _BY_TYPE.pop(old.cls, None)
    _BY_TYPE[cls] = conv
    _BY_NAME[name] = conv


def unregister_type(cls: type) -> None:
    """Remove a converter registered with :func:`register_type`."""
    conv = _BY_TYPE.pop(cls, None)
    if conv is not None:
        _BY_NAME.pop(conv.name, None)


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _path_text(path: tuple) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


class Encoder:
    """Encodes one state tree; tensors and arrays are handed to ``on_array(name, value)``."""

    def __init__(self, on_array: Callable[[str, Any], None] | None) -> None:
        # on_array=None: small arrays are embedded in the JSON ("$array"), for values that
        # live outside the chunk path (e.g. inside a multi-rank checkpoint's values).
        self._on_array = on_array
        self._names: set[str] = set()

    def _array_name(self, path: tuple) -> str:
        base = "/".join(_escape(str(k)) for k in path) or "_"
        name, n = base, 1
        while name in self._names:  # e.g. keys 1 and "1" under the same dict
            n += 1
            name = f"{base}~{n}"
        self._names.add(name)
        return name

    def encode(self, value: Any, path: tuple = ()) -> Any:
        t = type(value)
        if value is None or t is bool or t is str:
            return value
        if t is int:
            if -_SAFE_INT < value < _SAFE_INT:
                return value
            try:
                text = str(value)
            except ValueError:  # beyond sys.int_max_str_digits
                text = ""
            if not text or len(text.lstrip("-")) > _MAX_INT_DIGITS:
                raise UnsupportedTypeError(
                    f"{_path_text(path)}: int with more than {_MAX_INT_DIGITS} digits cannot be "
                    "stored; convert it (e.g. to bytes) or register a converter"
                )
            return {"$int": text}
        if t is float:
            if math.isfinite(value):
                return value
            return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        torch = sys.modules.get("torch")  # None: nothing here can be a torch value
        is_tensor = torch is not None and isinstance(value, torch.Tensor)
        if is_tensor and self._on_array is None:
            self._check_tensor(value, path)
            return _inline("torch", value)
        if t is np.ndarray and self._on_array is None and dtype_from_numpy(value.dtype):
            return _inline("numpy", value)
        if is_tensor:
            self._check_tensor(value, path)
            name = self._array_name(path)
            assert self._on_array is not None  # the is_tensor branch above returned if None
            self._on_array(name, value)
            return {"$tensor": name}
        if t is np.ndarray:
            if dtype_from_numpy(value.dtype) is None:
                raise UnsupportedTypeError(
                    f"{_path_text(path)}: numpy array of dtype {value.dtype} cannot be stored "
                    "safely (object/str/structured arrays need pickle); convert it or register "
                    "a converter with stepvault.state.register_type"
                )
            name = self._array_name(path)
            assert self._on_array is not None  # a supported dtype returned above if None
            self._on_array(name, value)
            return {"$ndarray": name}
        if isinstance(value, np.generic):
            dt = dtype_from_numpy(value.dtype)
            if dt is None:
                raise UnsupportedTypeError(
                    f"{_path_text(path)}: numpy scalar of dtype {value.dtype} is not supported"
                )
            raw = np.asarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
            return {"$npscalar": [dt, raw.hex()]}
        if t in (bytes, bytearray):
            return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
        if t is list:
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if t is tuple:
            return {"$tuple": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, dict) and (t is dict or t.__module__ == "collections"):
            return self._encode_dict(value, path)
        if torch is not None:
            if t is torch.dtype:
                return {"$dtype": _torch_dtype_names()[value]}
            if t is torch.Size:
                return {"$size": list(value)}
            if t is torch.device:
                return {"$device": str(value)}
        conv = _BY_TYPE.get(t) or next(
            (c for k, c in _BY_TYPE.items() if isinstance(value, k)), None
        )
        if conv is not None:
            return {"$ext": [conv.name, self.encode(conv.encode(value), path)]}
        raise UnsupportedTypeError(
            f"{_path_text(path)}: cannot store a value of type {t.__module__}.{t.__qualname__} "
            "safely (stepvault never pickles). Convert it to plain values (dict/list/str/"
            "numbers/tensors) or register a converter with stepvault.state.register_type(...)"
        )

    def _encode_dict(self, value: Mapping, path: tuple) -> Any:
        plain = True
        for k in value:
            if type(k) is str:
                if k.startswith("$"):
                    plain = False
            elif type(k) is int:
                plain = False
            else:
                raise UnsupportedTypeError(
                    f"{_path_text(path)}: dict key {k!r} of type {type(k).__name__} is not "
                    "supported (only str and int keys)"
                )
        if plain:
            return {k: self.encode(v, (*path, k)) for k, v in value.items()}
        return {
            "$dict": [[self.encode(k, path), self.encode(v, (*path, k))] for k, v in value.items()]
        }

    @staticmethod
    def _check_tensor(t: torch.Tensor, path: tuple) -> None:
        torch = _torch()
        if t.layout != torch.strided:
            raise UnsupportedTypeError(
                f"{_path_text(path)}: {t.layout} tensors are not supported; call .to_dense()"
            )
        if t.is_quantized or t.dtype not in _torch_dtype_names():
            raise UnsupportedTypeError(f"{_path_text(path)}: tensor dtype {t.dtype} not supported")
        if t.device.type == "meta":
            raise UnsupportedTypeError(
                f"{_path_text(path)}: tensor is on the meta device (no data to save)"
            )
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(
            t, torch.nn.parameter.Buffer | torch.nn.Parameter
        ):
            raise UnsupportedTypeError(
                f"{_path_text(path)}: tensor subclass {type(t).__name__} is not supported "
                "here (sharded DTensor state needs the distributed save)"
            )


def _inline(kind: str, value: Any) -> dict[str, Any]:
    dtype: str | None  # never None: callers inline only supported numpy dtypes
    if kind == "torch":
        torch = _torch()
        t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        dtype, shape = _torch_dtype_names()[t.dtype], list(t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    else:
        dtype, shape = dtype_from_numpy(value.dtype), list(value.shape)
        raw = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<")).tobytes()
    return {"$array": [kind, dtype, shape, base64.b64encode(raw).decode("ascii")]}


def _decode_inline(arg: Any) -> Any:
    kind, dtype, shape, data = _expect(arg, list)
    if kind not in ("torch", "numpy") or type(shape) is not list:
        raise ManifestError("bad $array")
    raw = bytearray(base64.b64decode(_expect(data, str), validate=True))
    info = dtype_info(_expect(dtype, str))
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ManifestError("bad $array shape")
        count *= d
    if count * info.itemsize != len(raw):
        raise ManifestError("$array data does not match its shape")
    if kind == "numpy":
        if info.numpy is None:
            raise ManifestError(f"numpy has no dtype {dtype!r}")
        return np.frombuffer(raw, dtype=info.numpy).reshape(shape)
    torch = _torch()
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return torch.frombuffer(raw, dtype=torch_dtype(dtype)).reshape(shape)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """Format dtype name of a torch dtype."""
    return _torch_dtype_names()[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """Torch dtype for a format dtype name (ValueError when this torch lacks it)."""
    dtype_info(name)
    try:
        return _torch_dtypes()[name]
    except KeyError:
        raise ValueError(f"this torch has no dtype {name!r}") from None


def decode_value(obj: Any, get_array: Callable[[str, str], Any]) -> Any:
    """Decode the JSON form produced by :class:`Encoder`.

    ``get_array(kind, name)`` returns the tensor (kind ``"tensor"``) or numpy array (kind
    ``"ndarray"``) stored under ``name``. Unknown tags raise :class:`ManifestError`.
    """
    try:
        return _decode(obj, get_array)
    except RecursionError:
        raise ManifestError("encoded state is nested too deeply") from None


def _decode(obj: Any, get_array):
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [_decode(v, get_array) for v in obj]
    if t is not dict:
        raise ManifestError(f"unexpected JSON value of type {t.__name__} in encoded state")
    tag = next((k for k in obj if k.startswith("$")), None)
    if tag is None:
        return {k: _decode(v, get_array) for k, v in obj.items()}
    if len(obj) != 1:
        raise ManifestError(f"tagged value {tag!r} has extra keys")
    arg = obj[tag]
    try:
        if tag == "$tensor":
            return get_array("tensor", _expect(arg, str))
        if tag == "$ndarray":
            return get_array("ndarray", _expect(arg, str))
        if tag == "$array":
            return _decode_inline(arg)
        if tag == "$float":
            if arg not in ("nan", "inf", "-inf"):
                raise ManifestError(f"bad $float value {arg!r}")
            return float(arg)
        if tag == "$int":
            text = _expect(arg, str)
            if len(text.lstrip("-")) > _MAX_INT_DIGITS:
                raise ManifestError("$int too long")
            return int(text)
        if tag == "$bytes":
            return base64.b64decode(_expect(arg, str), validate=True)
        if tag == "$tuple":
            return tuple(_decode(v, get_array) for v in _expect(arg, list))
        if tag == "$dict":
            out = {}
            for pair in _expect(arg, list):
                if type(pair) is not list or len(pair) != 2:
                    raise ManifestError("bad $dict entry")
                key = pair[0]
                if type(key) is dict and list(key) == ["$int"]:  # int key beyond 2**53
                    key = _decode(key, get_array)
                if type(key) not in (str, int):
                    raise ManifestError("bad $dict entry")
                out[key] = _decode(pair[1], get_array)
            return out
        if tag == "$npscalar":
            dt, hexdata = _expect(arg, list)
            np_name = dtype_info(_expect(dt, str)).numpy
            if np_name is None:
                raise ManifestError(f"numpy has no dtype {dt!r}")
            raw = bytes.fromhex(_expect(hexdata, str))
            if len(raw) != np.dtype(np_name).itemsize:
                raise ManifestError("$npscalar has the wrong number of bytes")
            return np.frombuffer(raw, dtype=np_name)[0].astype(np.dtype(np_name).newbyteorder("="))
        if tag == "$dtype":
            return torch_dtype(_expect(arg, str))
        if tag == "$size":
            dims = _expect(arg, list)
            # torch.Size accepts any int but breaks on first use beyond int64.
            if not all(type(d) is int and -(2**63) <= d < 2**63 for d in dims):
                raise ManifestError("bad $size")
            return _torch().Size(dims)
        if tag == "$device":
            try:
                return _torch().device(_expect(arg, str))
            except RuntimeError as exc:  # torch reports bad device strings as RuntimeError
                raise ManifestError(f"bad $device value: {exc}") from None
        if tag == "$ext":
            name, inner = _expect(arg, list)
            conv = _BY_NAME.get(name)
            if conv is None:
                raise UnsupportedTypeError(
                    f"checkpoint holds a value of registered type {name!r}, but this program "
                    "registered no converter for it; call stepvault.state.register_type(cls, "
                    f"{name!r}, encode, decode) before restoring"
                )
            return conv.decode(_decode(inner, get_array))
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ManifestError | UnsupportedTypeError):
            raise
        raise ManifestError(f"bad {tag} value: {exc}") from exc
    raise ManifestError(f"unknown tag {tag!r} in encoded state (written by a newer stepvault?)")


def _expect(value: Any, typ: type) -> Any:
    if type(value) is not typ:
        raise ManifestError(f"expected {typ.__name__}, got {type(value).__name__}")
    return value
