"""Manifests: serialise/parse round trip, checksum, versioning, schema checks, fuzzing."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepvault.errors import ManifestError, StoreVersionError
from stepvault.format.dtypes import DTYPES
from stepvault.format.encoding import Encoder
from stepvault.format.manifest import (
    LIGHT_MANIFEST_VERSION,
    MANIFEST_FORMAT_VERSION,
    MAX_MANIFEST_SIZE,
    Manifest,
    ObjectEntry,
    TensorEntry,
    parse_manifest,
    serialize_manifest,
)
from stepvault.format.objects import MAX_RAW_SIZE

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALLOWED = (ManifestError, StoreVersionError)

H1 = blake3(b"one").hexdigest()
H2 = blake3(b"two").hexdigest()


def sample_manifest() -> Manifest:
    state = Encoder(lambda n, v: None).encode(
        {"model": {"w": 1.5, "$odd": (1, 2)}, "step": 10, "nan": float("nan"), "b": b"\x00"}
    )
    return Manifest(
        run="exp1",
        step=12,
        created=1700000000.25,
        epoch=3,
        kind="full",
        parent_step=None,
        metrics={"loss": 0.5, "acc": 1.0},
        metadata={"note": "hello ü", "list": [1, 2]},
        state=state,
        state_kinds={"model": "module", "optimizer": "optimizer"},
        tensors={
            "model/w": TensorEntry("float32", [4, 8], [(H1, 0, 64), (H2, 64, 64)]),
            "model/b": TensorEntry("bfloat16", [3], [(H1, 64, 6)]),
            "opt/step": TensorEntry("int64", [], [(H2, 0, 8)], kind="ndarray"),
            "empty": TensorEntry("float16", [0, 5], []),
        },
        objects={
            H1: ObjectEntry("zstd", 200, 128),
            H2: ObjectEntry("raw", 192, 128),
        },
        stats={"new_bytes": 10, "seconds": 0.1},
        environment={"torch": "2.13"},
    )


def wrap(body: bytes, **envelope: Any) -> bytes:
    """A manifest file around ``body`` with a correct checksum (envelope fields overridable)."""
    env = {
        "format": "stepvault-manifest",
        "version": MANIFEST_FORMAT_VERSION,
        "body_blake3": blake3(body).hexdigest(),
        "body_size": len(body),
    }
    env.update(envelope)
    return json.dumps(env).encode() + b"\n" + body


def body_doc() -> dict[str, Any]:
    return sample_manifest().to_json()


def wrap_doc(doc: Any) -> bytes:
    return wrap(json.dumps(doc).encode())


# --- round trip ------------------------------------------------------------------------


def test_roundtrip_sample():
    m = sample_manifest()
    data = serialize_manifest(m)
    head, body = data.split(b"\n", 1)
    env = json.loads(head)
    assert env == {
        "format": "stepvault-manifest",
        "version": MANIFEST_FORMAT_VERSION,
        "body_blake3": blake3(body).hexdigest(),
        "body_size": len(body),
    }
    back = parse_manifest(data)
    assert back == m
    assert back.logical_bytes == 4 * 8 * 4 + 3 * 2 + 8
    assert back.stored_bytes == 392
    assert serialize_manifest(back) == data


def test_serialize_refuses_nan_metrics():
    m = sample_manifest()
    m.metrics["loss"] = math.nan
    with pytest.raises(ValueError):
        serialize_manifest(m)


hashes = st.binary(min_size=1, max_size=8).map(lambda b: blake3(b).hexdigest())
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**60), 2**60),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


@st.composite
def manifests(draw) -> Manifest:
    objects = {
        h: ObjectEntry(
            draw(st.sampled_from(["raw", "zstd", "float"])),
            draw(st.integers(0, 2**40)),
            draw(st.integers(0, 4096)),
        )
        for h in draw(st.lists(hashes, max_size=4, unique=True))
    }
    tensors = {}
    for name in draw(
        st.lists(
            st.text(min_size=1, max_size=12).filter(lambda s: "\x00" not in s),
            max_size=5,
            unique=True,
        )
    ):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        itemsize = DTYPES[dtype].itemsize
        fitting = [h for h, o in objects.items() if o.raw_size >= itemsize]
        chunks = []
        if fitting:
            for _ in range(draw(st.integers(0, 3))):
                h = draw(st.sampled_from(fitting))
                length = draw(st.integers(0, objects[h].raw_size // itemsize)) * itemsize
                off = draw(st.integers(0, objects[h].raw_size - length))
                chunks.append((h, off, length))
        count = sum(c[2] for c in chunks) // itemsize
        shape = [count] if draw(st.booleans()) or count == 0 else [1, count, 1]
        if count == 0 and draw(st.booleans()):
            shape = [0, draw(st.integers(0, 10**6))]
        tensors[name] = TensorEntry(
            dtype, shape, chunks, draw(st.sampled_from(["tensor", "ndarray"]))
        )
    return Manifest(
        run=draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_+-]{0,20}", fullmatch=True)),
        step=draw(st.integers(0, 10**18)),
        created=draw(st.floats(allow_nan=False, allow_infinity=False)),
        epoch=draw(st.one_of(st.none(), st.integers(0, 10**6))),
        kind=draw(st.sampled_from(["full", "delta"])),
        parent_step=draw(st.one_of(st.none(), st.integers(0, 10**6))),
        metrics=draw(
            st.dictionaries(
                st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False), max_size=3
            )
        ),
        metadata=draw(json_values),
        state=draw(json_values),
        state_kinds=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)),
        tensors=tensors,
        objects=objects,
        stats=draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
        environment=draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)),
    )


@settings(SETTINGS, max_examples=100)
@given(manifests())
def test_roundtrip_property(m):
    data = serialize_manifest(m)
    back = parse_manifest(data)
    assert back == m
    assert serialize_manifest(back) == data


# --- damage ------------------------------------------------------------------------------


def test_every_body_byte_flip_fails_the_checksum():
    data = serialize_manifest(sample_manifest())
    start = data.index(b"\n") + 1
    for pos in range(start, len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[pos] ^= mask
            with pytest.raises(ManifestError, match="checksum"):
                parse_manifest(bytes(bad))


def test_envelope_byte_flips_never_pass_silently():
    m = sample_manifest()
    data = serialize_manifest(m)
    for pos in range(data.index(b"\n") + 1):
        for mask in (0x01, 0x02, 0x80):
            bad = bytearray(data)
            bad[pos] ^= mask
            try:
                back = parse_manifest(bytes(bad))
            except ALLOWED:
                continue
            assert back == m  # e.g. version 1 -> 0 still names an understood format


def test_every_truncation_is_a_manifest_error():
    data = serialize_manifest(sample_manifest())
    for n in range(len(data)):
        with pytest.raises(ManifestError):
            parse_manifest(data[:n], "exp1@12")


def test_appended_bytes_are_a_manifest_error():
    data = serialize_manifest(sample_manifest())
    for extra in (b"\n", b" ", b"{}"):
        with pytest.raises(ManifestError, match=r"truncated|body"):
            parse_manifest(data + extra)


def test_error_messages_name_the_manifest():
    with pytest.raises(ManifestError, match=r"^exp1@12: "):
        parse_manifest(b"garbage", "exp1@12")


# version 2 is a light checkpoint's manifest (issue 17): the next one is refused
@pytest.mark.parametrize("version", [LIGHT_MANIFEST_VERSION + 1, 99, 2**40])
def test_newer_version(version):
    body = serialize_manifest(sample_manifest()).split(b"\n", 1)[1]
    with pytest.raises(StoreVersionError, match="upgrade stepvault"):
        parse_manifest(wrap(body, version=version))


@pytest.mark.parametrize(
    "envelope",
    [
        {"format": "safetensors"},
        {"format": None},
        {"body_size": None},
        {"body_size": -1},
        {"body_blake3": "0" * 64},
        {"body_blake3": None},
    ],
)
def test_bad_envelope_fields(envelope):
    body = serialize_manifest(sample_manifest()).split(b"\n", 1)[1]
    with pytest.raises(ManifestError):
        parse_manifest(wrap(body, **envelope))


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"[]",
        b"{}",
        b"null",
        b'"x"',
        b'{"format": "stepvault-manifest"}',
        b"{",
        b"\xff",
        b"[" * 100_000,
    ],
)
def test_damaged_envelope_line(head):
    with pytest.raises(ManifestError, match="envelope"):
        parse_manifest(head + b"\n{}")


def test_oversized_manifest_is_refused_before_parsing():
    class Huge(bytes):
        def __len__(self):
            return MAX_MANIFEST_SIZE + 1

    with pytest.raises(ManifestError, match="exceeds the limit"):
        parse_manifest(Huge(b"x"))


# --- schema -------------------------------------------------------------------------------


def _mutate(fn):
    doc = body_doc()
    fn(doc)
    return wrap_doc(doc)


SCHEMA_VIOLATIONS = {
    "chunk beyond object": lambda d: d["tensors"]["model/b"].update(chunks=[[H1, 124, 6]]),
    "chunk offset+length overflow": lambda d: d["tensors"]["model/b"].update(
        chunks=[[H1, 2**70, 6]]
    ),
    "absurd shape": lambda d: d["tensors"]["model/b"].update(shape=[10**12, 10**12]),
    "shape too small": lambda d: d["tensors"]["model/w"].update(shape=[4, 7]),
    "unlisted object": lambda d: d["tensors"]["model/b"].update(
        chunks=[[blake3(b"x").hexdigest(), 0, 6]]
    ),
    "NUL in tensor name": lambda d: d["tensors"].update({"a\x00b": d["tensors"].pop("model/b")}),
    "empty tensor name": lambda d: d["tensors"].update({"": d["tensors"].pop("model/b")}),
    "bad object hash": lambda d: d["objects"].update(
        {"XYZ": {"codec": "raw", "size": 1, "raw_size": 1}}
    ),
    "uppercase object hash": lambda d: d["objects"].update(
        {H1.upper(): {"codec": "raw", "size": 1, "raw_size": 1}}
    ),
    "negative raw_size": lambda d: d["objects"][H1].update(raw_size=-1),
    "raw_size beyond limit": lambda d: d["objects"][H1].update(raw_size=MAX_RAW_SIZE + 1),
    "raw_size float": lambda d: d["objects"][H1].update(raw_size=128.0),
    "raw_size bool": lambda d: d["objects"][H2].update(raw_size=True),
    "size string": lambda d: d["objects"][H1].update(size="200"),
    "codec not str": lambda d: d["objects"][H1].update(codec=3),
    "object not a dict": lambda d: d["objects"].update({H1: [1, 2, 3]}),
    "objects missing": lambda d: d.pop("objects"),
    "objects a list": lambda d: d.update(objects=[]),
    "tensors missing": lambda d: d.pop("tensors"),
    "negative dim": lambda d: d["tensors"]["model/b"].update(shape=[-3]),
    "float dim": lambda d: d["tensors"]["model/b"].update(shape=[3.0]),
    "shape not list": lambda d: d["tensors"]["model/b"].update(shape=3),
    "too many dims": lambda d: d["tensors"]["empty"].update(shape=[1] * 65),
    "unknown kind": lambda d: d["tensors"]["model/b"].update(kind="sparse"),
    "unknown dtype": lambda d: d["tensors"]["model/b"].update(dtype="float128"),
    "dtype not str": lambda d: d["tensors"]["model/b"].update(dtype=["bfloat16"]),
    "chunk pair": lambda d: d["tensors"]["model/b"].update(chunks=[[H1, 64]]),
    "chunk dict": lambda d: d["tensors"]["model/b"].update(chunks=[{"h": H1}]),
    "chunk hash list": lambda d: d["tensors"]["model/b"].update(chunks=[[[H1], 64, 6]]),
    "negative offset": lambda d: d["tensors"]["model/b"].update(chunks=[[H1, -1, 6]]),
    "chunks not a list": lambda d: d["tensors"]["model/b"].update(chunks=5),
    "tensor not a dict": lambda d: d["tensors"].update({"x": "y"}),
    "negative step": lambda d: d.update(step=-1),
    "bool step": lambda d: d.update(step=True),
    "string step": lambda d: d.update(step="12"),
    "run not str": lambda d: d.update(run=5),
    "run with a path": lambda d: d.update(run="../escape"),
    "created huge int": lambda d: d.update(created=10**400),
    "created list": lambda d: d.update(created=[1]),
    "created missing": lambda d: d.pop("created"),
    "epoch negative": lambda d: d.update(epoch=-2),
    "parent_step float": lambda d: d.update(parent_step=1.5),
    "metrics list": lambda d: d.update(metrics=[1]),
    "state_kinds string": lambda d: d.update(state_kinds="ab"),
}


@pytest.mark.parametrize("name", SCHEMA_VIOLATIONS)
def test_schema_violations(name):
    data = _mutate(SCHEMA_VIOLATIONS[name])
    with pytest.raises(ManifestError):
        parse_manifest(data, "exp1@12")


def test_schema_messages():
    with pytest.raises(ManifestError, match="beyond its object"):
        parse_manifest(_mutate(SCHEMA_VIOLATIONS["chunk beyond object"]))
    with pytest.raises(ManifestError, match="chunks hold 6"):
        parse_manifest(_mutate(SCHEMA_VIOLATIONS["absurd shape"]))
    with pytest.raises(ManifestError, match="unlisted object"):
        parse_manifest(_mutate(SCHEMA_VIOLATIONS["unlisted object"]))
    with pytest.raises(ManifestError, match="bad tensor name"):
        parse_manifest(_mutate(SCHEMA_VIOLATIONS["NUL in tensor name"]))


@pytest.mark.parametrize(
    "body",
    [b"", b"[]", b"null", b"5", b'"x"', b"{", b"\xff\xfe", b"[" * 100_000, b'{"a":' * 50_000],
)
def test_body_not_a_manifest(body):
    with pytest.raises(ManifestError):
        parse_manifest(wrap(body))


def test_optional_fields_default():
    doc = {"run": "r", "step": 0, "created": 0, "objects": {}, "tensors": {}}
    m = parse_manifest(wrap_doc(doc))
    assert m == Manifest(run="r", step=0, created=0.0)


# --- fuzzing ---------------------------------------------------------------------------


@SETTINGS
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data):
    try:
        parse_manifest(data)
    except ALLOWED:
        pass


any_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _parse_or_fail_cleanly(data: bytes) -> Manifest | None:
    try:
        m = parse_manifest(data)
    except ALLOWED:
        return None
    # Anything accepted satisfies the invariants readers rely on.
    for t in m.tensors.values():
        assert sum(c[2] for c in t.chunks) == t.nbytes
        for digest, off, length in t.chunks:
            assert off + length <= m.objects[digest].raw_size
    return m


@SETTINGS
@given(any_json)
def test_fuzz_envelope_around_arbitrary_json(doc):
    _parse_or_fail_cleanly(wrap(json.dumps(doc).encode()))


@SETTINGS
@given(head=any_json, body=st.binary(max_size=64))
def test_fuzz_arbitrary_envelopes(head, body):
    _parse_or_fail_cleanly(json.dumps(head).encode() + b"\n" + body)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@settings(SETTINGS, max_examples=200)
@given(data=st.data())
def test_fuzz_valid_manifest_with_one_subtree_replaced(data):
    doc = body_doc()
    path = data.draw(st.sampled_from(_paths(doc)[1:]))
    replacement = data.draw(
        st.one_of(any_json, st.integers(-(2**70), 2**70), st.sampled_from([H1, H2, 10**400]))
    )
    target = doc
    for k in path[:-1]:
        target = target[k]
    if data.draw(st.booleans()) and isinstance(target, dict):
        del target[path[-1]]
    else:
        target[path[-1]] = replacement
    _parse_or_fail_cleanly(wrap(json.dumps(doc).encode()))
