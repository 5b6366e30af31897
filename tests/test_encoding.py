"""The safe (pickle-free) encoding of non-tensor state: round trips, refusals, fuzzing."""

from __future__ import annotations

import collections
import json
import math
import warnings
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepvault.errors import ManifestError, UnsupportedTypeError
from stepvault.format.dtypes import DTYPES
from stepvault.format.encoding import (
    Encoder,
    decode_value,
    register_type,
    torch_dtype,
    torch_dtype_name,
    unregister_type,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ---------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Strict structural equality: same types, nan == nan, signed zeros, numpy bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor | np.ndarray):
        return a is b
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        ka, kb = list(a), list(b)
        return (
            len(ka) == len(kb)
            and all(same(x, y) for x, y in zip(ka, kb))
            and all(same(a[k], b[k]) for k in ka)
        )
    return a == b


def test_same_helper_can_fail():
    assert same(float("nan"), float("nan"))
    assert not same(0.0, -0.0)
    assert not same(1, True)
    assert not same([1], (1,))
    assert not same({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert not same(np.float32(1), np.float64(1))
    assert not same({1: 0}, {"1": 0})


class Arrays:
    """Collects arrays handed to ``on_array``; serves them back to ``decode_value``."""

    def __init__(self) -> None:
        self.by_name: dict[str, Any] = {}

    def __call__(self, name: str, value: Any) -> None:
        assert isinstance(name, str) and name
        assert name not in self.by_name, f"array name {name!r} handed out twice"
        self.by_name[name] = value

    def get(self, kind: str, name: str) -> Any:
        value = self.by_name[name]
        assert kind == ("tensor" if isinstance(value, torch.Tensor) else "ndarray")
        return value


def roundtrip(value: Any) -> tuple[Any, Any, Arrays]:
    """Encode, prove the result is plain JSON, decode from the JSON text."""
    arrays = Arrays()
    encoded = Encoder(arrays).encode(value)
    text = json.dumps(encoded, allow_nan=False)
    decoded = decode_value(json.loads(text), arrays.get)
    return encoded, decoded, arrays


def _never(kind, name):
    raise AssertionError("no arrays expected")


# --- strategies ------------------------------------------------------------------------

NUMPY_DTYPES = [d.numpy for d in DTYPES.values() if d.numpy]
TORCH_DTYPES = [torch_dtype(n) for n in DTYPES if hasattr(torch, n)]


@st.composite
def numpy_scalars(draw):
    dt = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    if dt.kind == "b":
        return np.bool_(draw(st.booleans()))
    raw = draw(st.binary(min_size=dt.itemsize, max_size=dt.itemsize))
    order = draw(st.sampled_from(["<", ">"]))
    return np.frombuffer(raw, dtype=dt.newbyteorder(order))[0]


ints = st.one_of(
    st.integers(),
    st.integers(2**53 - 3, 2**53 + 3),
    st.integers(-(2**53) - 3, -(2**53) + 3),
    st.integers(2**62, 2**200),
    st.integers(-(2**200), -(2**62)),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 1.7976931348623157e308]
    ),
)
texts = st.one_of(
    st.text(max_size=10), st.sampled_from(["$int", "$tensor", "$", "$$x", "a/b", "%2F"])
)
keys = st.one_of(texts, ints)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    texts,
    st.binary(max_size=16),
    numpy_scalars(),
    st.sampled_from(TORCH_DTYPES),
    st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    st.sampled_from(["cpu", "cuda", "cuda:1", "meta", "mps", "xpu:3"]).map(torch.device),
    st.integers(0, 5).map(lambda n: torch.arange(n, dtype=torch.float32)),
    st.integers(0, 5).map(lambda n: np.arange(n, dtype=np.int16)),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(texts, inner, max_size=4),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=25,
)


# --- round trips -----------------------------------------------------------------------


@SETTINGS
@given(values)
def test_roundtrip_property(value):
    encoded, decoded, arrays = roundtrip(value)
    assert same(decoded, value)
    # The encoded form without the JSON text step decodes the same.
    assert same(decode_value(encoded, arrays.get), value)


@SETTINGS
@given(st.dictionaries(keys, st.integers(), max_size=8))
def test_dicts_with_mixed_and_huge_int_keys(d):
    _, decoded, _ = roundtrip({"d": d})
    assert same(decoded, {"d": d})


@pytest.mark.parametrize(
    "value",
    [
        2**53 - 1,
        2**53,
        -(2**53),
        -(2**53) + 1,
        2**64,
        -(2**64),
        10**4299,
        -(10**4300 - 1),  # 4300 digits plus the sign
        10**4300 - 1,
    ],
)
def test_int_boundaries(value):
    encoded, decoded, _ = roundtrip(value)
    assert same(decoded, value)
    if abs(value) >= 2**53:
        assert encoded == {"$int": str(value)}
    else:
        assert encoded == value


def test_int_with_too_many_digits_is_refused_at_save():
    with pytest.raises(UnsupportedTypeError, match=r"\['x'\].*digits"):
        Encoder(_never).encode({"x": 10**4300})


def test_special_floats_and_signed_zero():
    value = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 0.1]
    encoded, decoded, _ = roundtrip(value)
    assert encoded[:3] == [{"$float": "nan"}, {"$float": "inf"}, {"$float": "-inf"}]
    assert json.dumps(encoded[3]) == "-0.0"
    assert same(decoded, value)


def test_forms_of_each_type():
    enc = Encoder(_never).encode
    assert enc(b"\x00\xff") == {"$bytes": "AP8="}
    assert enc(bytearray(b"\x00\xff")) == {"$bytes": "AP8="}
    assert enc((1, 2)) == {"$tuple": [1, 2]}
    assert enc({"a": 1}) == {"a": 1}
    assert enc({"$a": 1}) == {"$dict": [["$a", 1]]}
    assert enc({1: "a", "1": "b"}) == {"$dict": [[1, "a"], ["1", "b"]]}
    assert enc(torch.bfloat16) == {"$dtype": "bfloat16"}
    assert enc(torch.Size([2, 3])) == {"$size": [2, 3]}
    assert enc(torch.device("cuda:1")) == {"$device": "cuda:1"}
    assert enc(np.int32(-2)) == {"$npscalar": ["int32", "feffffff"]}
    assert enc(np.array(-2, dtype=">i4")[()]) == {"$npscalar": ["int32", "feffffff"]}
    assert enc(np.float16(1.5)) == {"$npscalar": ["float16", "003e"]}
    assert enc(np.bool_(True)) == {"$npscalar": ["bool", "01"]}
    assert decode_value({"$bytes": "AP8="}, _never) == b"\x00\xff"
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    assert same(decode_value(enc(od), _never), {"b": 1, "a": 2})
    dd = collections.defaultdict(list, {"x": [1]})
    assert same(decode_value(enc(dd), _never), {"x": [1]})


@SETTINGS
@given(numpy_scalars())
def test_numpy_scalars_keep_dtype_and_bits(x):
    _, decoded, _ = roundtrip(x)
    assert isinstance(decoded, np.generic)
    assert decoded.dtype == x.dtype.newbyteorder("=")
    assert decoded.tobytes() == x.astype(x.dtype.newbyteorder("=")).tobytes()


def test_torch_dtype_names_roundtrip():
    for dt in TORCH_DTYPES:
        assert torch_dtype(torch_dtype_name(dt)) is dt
        _, decoded, _ = roundtrip({"dt": dt})
        assert decoded["dt"] is dt
    with pytest.raises(ValueError):
        torch_dtype("float128")


def test_tensors_and_arrays_go_through_on_array_with_path_names():
    t1, t2, t3 = torch.zeros(2), torch.ones(3, dtype=torch.bfloat16), torch.arange(4)
    a1 = np.arange(6, dtype=np.float64).reshape(2, 3)
    p = torch.nn.Parameter(torch.ones(2))
    state = {
        "model": {"fc.weight": t1, "a/b": t2, "%": t3},
        "opt": {"state": {0: {"exp_avg": a1}, "0": {"exp_avg": p}}},
        "list": [t1],
    }
    encoded, decoded, arrays = roundtrip(state)
    assert set(arrays.by_name) == {
        "model/fc.weight",
        "model/a%2Fb",
        "model/%25",
        "opt/state/0/exp_avg",
        "opt/state/0/exp_avg~2",
        "list/0",
    }
    assert arrays.by_name["model/fc.weight"] is t1
    assert arrays.by_name["list/0"] is t1
    assert encoded["model"]["fc.weight"] == {"$tensor": "model/fc.weight"}
    assert encoded["opt"]["state"]["$dict"][0][1]["exp_avg"] == {"$ndarray": "opt/state/0/exp_avg"}
    assert same(decoded, state)
    assert decoded["opt"]["state"]["0"]["exp_avg"] is p
    # A bare tensor at the root still gets a name.
    _, _, arrays = roundtrip(t1)
    assert list(arrays.by_name) == ["_"]


# --- refusals --------------------------------------------------------------------------


class Custom:
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated, still refused
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)


@pytest.mark.parametrize(
    ("bad", "type_text"),
    [
        (Custom(), "Custom"),
        ({1, 2}, "set"),
        (frozenset(), "frozenset"),
        (lambda x: x, "function"),
        (np.array([object()], dtype=object), "object"),
        (np.array(["a"]), "<U1"),
        ({(1, 2): 3}, "tuple"),
        ({True: 3}, "bool"),
        ({1.5: 3}, "float"),
        (1 + 2j, "complex"),
        (np.str_("x"), "<U1"),
        (np.datetime64("2020-01-01"), "datetime64"),
        (torch.zeros(2).to_sparse(), "sparse"),
        (torch.empty(2, device="meta"), "meta"),
        (_quantized(), "quint8"),
        (range(3), "range"),
        (Ellipsis, "ellipsis"),
    ],
)
def test_refusals_name_path_and_type(bad, type_text):
    state = {"opt": {"x": bad}, "ok": 1}
    with pytest.raises(UnsupportedTypeError) as info:
        Encoder(lambda name, value: None).encode(state)
    msg = str(info.value)
    # Dict-key problems are reported at the dict's own path.
    assert "state['opt']['x']" in msg
    assert type_text in msg
    assert isinstance(info.value, TypeError)


def test_refusal_inside_lists_and_tuples_reports_indices():
    with pytest.raises(UnsupportedTypeError, match=r"state\['a'\]\[1\]\[0\]: .*Custom"):
        Encoder(_never).encode({"a": [0, (Custom(),)]})
    with pytest.raises(UnsupportedTypeError, match=r"state\[3\]\['k'\]"):
        Encoder(_never).encode({3: {"k": {1, 2}}})


def test_tensor_subclass_is_refused():
    class MyTensor(torch.Tensor):
        pass

    t = torch.zeros(2).as_subclass(MyTensor)
    with pytest.raises(UnsupportedTypeError, match="subclass MyTensor"):
        Encoder(lambda n, v: None).encode({"w": t})


# --- registered types ------------------------------------------------------------------


@pytest.fixture
def fraction_registered():
    register_type(
        Fraction,
        "fractions.Fraction",
        encode=lambda f: [f.numerator, f.denominator],
        decode=lambda v: Fraction(*v),
    )
    try:
        yield
    finally:
        unregister_type(Fraction)


def test_register_type_roundtrip(fraction_registered):
    value = {"lr": Fraction(1, 3), "big": Fraction(2**80, 3), "l": [Fraction(-5, 7)]}
    encoded, decoded, _ = roundtrip(value)
    assert encoded["lr"] == {"$ext": ["fractions.Fraction", [1, 3]]}
    assert encoded["big"] == {"$ext": ["fractions.Fraction", [{"$int": str(2**80)}, 3]]}
    assert decoded == value
    assert type(decoded["lr"]) is Fraction


def test_registered_subclass_uses_the_base_converter(fraction_registered):
    class MyFraction(Fraction):
        pass

    encoded, decoded, _ = roundtrip(MyFraction(1, 2))
    assert encoded == {"$ext": ["fractions.Fraction", [1, 2]]}
    assert decoded == Fraction(1, 2)


def test_registered_type_may_hold_tensors():
    class Box:
        def __init__(self, t):
            self.t = t

    register_type(Box, "tests.Box", encode=lambda b: {"t": b.t}, decode=lambda v: Box(v["t"]))
    try:
        t = torch.ones(3)
        encoded, decoded, _ = roundtrip({"box": Box(t)})
        assert encoded == {"box": {"$ext": ["tests.Box", {"t": {"$tensor": "box/t"}}]}}
        assert decoded["box"].t is t
    finally:
        unregister_type(Box)


def test_unregister_then_encode_and_decode_refuse():
    register_type(Fraction, "fractions.Fraction", lambda f: [1, 1], lambda v: Fraction(*v))
    encoded = Encoder(_never).encode({"f": Fraction(1, 1)})
    unregister_type(Fraction)
    unregister_type(Fraction)  # idempotent
    with pytest.raises(UnsupportedTypeError, match="Fraction"):
        Encoder(_never).encode({"f": Fraction(1, 1)})
    with pytest.raises(UnsupportedTypeError) as info:
        decode_value(json.loads(json.dumps(encoded)), _never)
    msg = str(info.value)
    assert "fractions.Fraction" in msg
    assert "register_type" in msg


def test_register_type_needs_a_name():
    for name in ("", None, 3):
        with pytest.raises(ValueError):
            register_type(Fraction, name, str, str)


# --- malformed encoded values ----------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"$foo": 1},
        {"$": 1},
        {"$int": "1", "x": 2},
        {"a": 1, "$int": "1"},
        {"$int": 5},
        {"$int": "abc"},
        {"$int": "1" * 4301},
        {"$float": "NaN"},
        {"$float": 1.0},
        {"$float": ["nan"]},
        {"$bytes": "!!"},
        {"$bytes": "AAA"},
        {"$bytes": 3},
        {"$tuple": 3},
        {"$tuple": {"a": 1}},
        {"$dict": 3},
        {"$dict": [[1]]},
        {"$dict": [[[1], 2]]},
        {"$dict": [[1.5, 2]]},
        {"$dict": [[None, 2]]},
        {"$dict": [[{"$tuple": []}, 2]]},
        {"$dict": [[{"$int": "x"}, 2]]},
        {"$dict": ["ab"]},
        {"$npscalar": ["int32", "00"]},
        {"$npscalar": ["bfloat16", "0000"]},
        {"$npscalar": ["nope", "00"]},
        {"$npscalar": "x"},
        {"$npscalar": ["int32"]},
        {"$npscalar": ["int32", "zz zz"]},
        {"$npscalar": [5, "00"]},
        {"$dtype": "float128"},
        {"$dtype": 1},
        {"$size": [1.5]},
        {"$size": "x"},
        {"$size": [2**70]},
        {"$device": "foo"},
        {"$device": "cuda:x"},
        {"$device": ""},
        {"$device": 3},
        {"$ext": "x"},
        {"$ext": [1, 2, 3]},
        {"$ext": [["name"], 2]},
        {"$tensor": 3},
        {"$ndarray": None},
        {1, 2},
        (1, 2),
        b"bytes",
        object(),
    ],
)
def test_malformed_values_raise_manifest_error(bad):
    for wrapped in (bad, [bad], {"k": bad}, {"$tuple": [bad]}):
        with pytest.raises(ManifestError):
            decode_value(wrapped, lambda kind, name: None)


def test_deep_nesting_is_a_manifest_error():
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ManifestError, match="nested too deeply"):
        decode_value(deep, _never)


# --- fuzzing ---------------------------------------------------------------------------

TAGS = [
    "$tensor",
    "$ndarray",
    "$float",
    "$int",
    "$bytes",
    "$tuple",
    "$dict",
    "$npscalar",
    "$dtype",
    "$size",
    "$device",
    "$ext",
    "$nope",
]
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(
        ["nan", "inf", "-inf", "AP8=", "int32", "float16", "bool", "cpu", "cuda:0", "0000", "01"]
    ),
)


def _json_extend(inner):
    tagged = st.builds(lambda tag, arg: {tag: arg}, st.sampled_from(TAGS), inner)
    return st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=5), st.sampled_from(TAGS)), inner, max_size=4),
        tagged,
        tagged,
    )


json_values = st.recursive(json_scalars, _json_extend, max_leaves=20)


@settings(SETTINGS, max_examples=200)
@given(json_values)
def test_fuzz_decode_value(obj):
    try:
        result = decode_value(obj, lambda kind, name: object())
    except (ManifestError, UnsupportedTypeError):
        return
    repr(result)  # what comes back is sound (e.g. no torch.Size that breaks on use)


@SETTINGS
@given(values)
def test_fuzz_encoded_then_mutated(value):
    # Encoded forms with one leaf replaced by a hostile tagged value still fail cleanly.
    arrays = Arrays()
    encoded = Encoder(arrays).encode(value)
    for hostile in ({"$npscalar": ["float64", "00"]}, {"$device": "x"}, {"$size": [-1, 2**64]}):
        try:
            decode_value([encoded, hostile], arrays.get)
        except ManifestError:
            continue
        raise AssertionError(f"{hostile} accepted")
