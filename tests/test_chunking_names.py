"""Chunk planning invariants; run-name, step, storage-key and reference validation."""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepvault.catalog.refs import parse_ref
from stepvault.errors import InvalidNameError
from stepvault.format.chunking import (
    BUNDLE_ALIGN,
    DEFAULT_BUNDLE_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_SMALL_TENSOR,
    ArraySpec,
    plan_chunks,
)
from stepvault.format.dtypes import DTYPES
from stepvault.store.names import check_key, validate_run_name, validate_step

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- chunk planning ------------------------------------------------------------------------


@st.composite
def array_specs(draw, max_elems: int = 40_000):
    dtypes = draw(st.lists(st.sampled_from(sorted(DTYPES)), min_size=1, max_size=4, unique=True))
    out = []
    for i in range(draw(st.integers(0, 25))):
        dtype = draw(st.sampled_from(dtypes))
        itemsize = DTYPES[dtype].itemsize
        count = draw(st.one_of(st.integers(0, 64), st.integers(0, max_elems)))
        out.append(ArraySpec(f"a{i}", dtype, itemsize, count * itemsize))
    return out


def check_plan(specs, plans, *, chunk_size, small_tensor, bundle_size):
    by_name = {a.name: a for a in specs}
    order = {a.name: i for i, a in enumerate(specs)}
    covered: dict[str, list[tuple[int, int]]] = {a.name: [] for a in specs}
    bundled = {a.name for a in specs if 0 < a.nbytes < small_tensor and a.nbytes <= bundle_size}
    last_bundle: dict[str, object] = {}
    for plan in plans:
        assert plan.members, "no empty objects"
        assert plan.size > 0
        names = [m[0] for m in plan.members]
        in_bundle = names[0] in bundled
        assert all((n in bundled) == in_bundle for n in names), "bundles hold only small arrays"
        for name, off, at, length in plan.members:
            a = by_name[name]
            assert plan.dtype == a.dtype, "one dtype per object"
            assert length > 0
            assert at >= 0 and at + length <= plan.size
            assert off % a.itemsize == 0 and length % a.itemsize == 0, "element aligned"
            covered[name].append((off, length))
        if in_bundle:
            assert plan.size <= bundle_size
            assert all(m[1] == 0 and m[3] == by_name[m[0]].nbytes for m in plan.members)
            starts = [m[2] for m in plan.members]
            assert starts[0] == 0
            assert all(s % BUNDLE_ALIGN == 0 for s in starts), "members are 64-byte aligned"
            ends = [m[2] + m[3] for m in plan.members]
            assert all(e <= s for e, s in zip(ends, starts[1:])), "members do not overlap"
            assert all(s - e < BUNDLE_ALIGN for e, s in zip(ends, starts[1:])), "packed tightly"
            assert plan.size == ends[-1]
            assert [order[n] for n in names] == sorted(order[n] for n in names), "state order"
            prev = last_bundle.get(plan.dtype)
            if prev is not None:
                # A new bundle of this dtype is started only when the next member did not fit.
                aligned = -(-prev.size // BUNDLE_ALIGN) * BUNDLE_ALIGN
                assert aligned + plan.members[0][3] > bundle_size
            last_bundle[plan.dtype] = plan
        else:
            assert len(plan.members) == 1
            name, off, at, length = plan.members[0]
            assert at == 0 and plan.size == length
            assert length <= chunk_size
            assert not plan.is_bundle
    for a in specs:
        pieces = sorted(covered[a.name])
        if a.nbytes == 0:
            assert pieces == []
            continue
        pos = 0
        for off, length in pieces:
            assert off == pos, f"{a.name}: gap or overlap at {pos}"
            pos += length
        assert pos == a.nbytes, f"{a.name}: {pos} of {a.nbytes} bytes covered"
        if a.name not in bundled:
            # Chunks are full-sized except the last one.
            step = chunk_size - chunk_size % a.itemsize
            assert all(length == step for _, length in pieces[:-1])


@SETTINGS
@given(
    specs=array_specs(),
    chunk_size=st.integers(1024, 70_000),
    small_tensor=st.integers(0, 50_000),
    bundle_size=st.integers(1, 80_000),
)
def test_plan_invariants(specs, chunk_size, small_tensor, bundle_size):
    plans = plan_chunks(
        specs, chunk_size=chunk_size, small_tensor=small_tensor, bundle_size=bundle_size
    )
    check_plan(
        specs, plans, chunk_size=chunk_size, small_tensor=small_tensor, bundle_size=bundle_size
    )


@settings(SETTINGS, max_examples=100)
@given(specs=array_specs(max_elems=3_000_000))
def test_plan_invariants_with_defaults(specs):
    plans = plan_chunks(specs)
    check_plan(
        specs,
        plans,
        chunk_size=DEFAULT_CHUNK_SIZE,
        small_tensor=DEFAULT_SMALL_TENSOR,
        bundle_size=DEFAULT_BUNDLE_SIZE,
    )


def test_big_tensor_is_split_into_fixed_offsets():
    mib = 1 << 20
    plans = plan_chunks([ArraySpec("w", "float32", 4, 100 * mib)])
    assert [(p.members[0][1], p.size) for p in plans] == [
        (0, 32 * mib),
        (32 * mib, 32 * mib),
        (64 * mib, 32 * mib),
        (96 * mib, 4 * mib),
    ]
    assert all(p.dtype == "float32" and not p.is_bundle for p in plans)


def test_chunk_size_rounds_down_to_whole_elements():
    plans = plan_chunks(
        [ArraySpec("c", "complex128", 16, 16 * 1000)], chunk_size=1030, small_tensor=0
    )
    assert {p.size for p in plans[:-1]} == {1024}
    assert sum(p.size for p in plans) == 16 * 1000


def test_small_tensors_are_bundled_per_dtype_in_order():
    specs = [
        ArraySpec("a", "float32", 4, 12),
        ArraySpec("b", "int64", 8, 8),
        ArraySpec("c", "float32", 4, 100),
        ArraySpec("big", "float32", 4, 2 << 20),
        ArraySpec("d", "float32", 4, 4),
        ArraySpec("z", "float32", 4, 0),
    ]
    plans = plan_chunks(specs)
    f32 = [p for p in plans if p.dtype == "float32" and p.is_bundle]
    assert len(f32) == 1
    assert f32[0].members == [("a", 0, 0, 12), ("c", 0, 64, 100), ("d", 0, 192, 4)]
    assert f32[0].size == 196
    i64 = [p for p in plans if p.dtype == "int64"]
    assert len(i64) == 1 and i64[0].members == [("b", 0, 0, 8)]
    assert not i64[0].is_bundle  # a lone member at offset 0 reads like a plain chunk
    assert all("z" not in [m[0] for m in p.members] for p in plans)


def test_bundle_rolls_over_when_full():
    specs = [ArraySpec(f"t{i}", "uint8", 1, 600) for i in range(5)]
    plans = plan_chunks(specs, small_tensor=1000, bundle_size=1300)
    assert [[m[0] for m in p.members] for p in plans] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [p.size for p in plans] == [640 + 600, 1240, 600]


def test_small_tensor_larger_than_a_bundle_is_chunked_not_oversized():
    # Settings where small_tensor > bundle_size: no object may exceed bundle_size as a bundle.
    specs = [ArraySpec("x", "float32", 4, 4000), ArraySpec("y", "float32", 4, 40)]
    plans = plan_chunks(specs, chunk_size=1024, small_tensor=1 << 20, bundle_size=2048)
    assert all(p.size <= 2048 for p in plans)
    assert sum(p.size for p in plans if p.members[0][0] == "x") == 4000


def test_chunk_size_minimum():
    with pytest.raises(ValueError, match="at least 1 KiB"):
        plan_chunks([], chunk_size=1023)
    assert plan_chunks([]) == []


# --- run names -----------------------------------------------------------------------------

GOOD_NAMES = ["exp1", "llama-7b.v2", "a", "A_b+c-d.e", "0", "x" * 128, "run.1.2", "7B"]
BAD_NAMES = [
    "",
    "..",
    ".",
    "../x",
    "x/../y",
    "a..b",
    "a/b",
    "/abs",
    "a\\b",
    "a\x00b",
    "\x00",
    "x" * 129,
    ".hidden",
    "-flag",
    "_x",
    "+x",
    "a b",
    "a\tb",
    "exp1\n",
    "\nexp1",
    "exp1\r",
    "ünï",
    "a:b",
    "a@1",
    "C:",
    "~",
    "a*",
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_run_names(name):
    assert validate_run_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_run_names(name):
    with pytest.raises(InvalidNameError, match="invalid run name"):
        validate_run_name(name)


@pytest.mark.parametrize("name", [None, 1, b"exp1", ["exp1"]])
def test_run_name_must_be_str(name):
    with pytest.raises(InvalidNameError, match="must be a str"):
        validate_run_name(name)


def test_invalid_name_error_is_a_value_error():
    assert issubclass(InvalidNameError, ValueError)


_SAFE = set(string.ascii_letters + string.digits + "._+-")


@SETTINGS
@given(st.one_of(st.text(max_size=140), st.text(alphabet="ab./\\\n-_+\x00", max_size=12)))
def test_accepted_run_names_are_safe(name):
    try:
        validate_run_name(name)
    except InvalidNameError:
        ok = False
    else:
        ok = True
    safe = (
        1 <= len(name) <= 128
        and set(name) <= _SAFE
        and name[0].isascii()
        and name[0].isalnum()
        and ".." not in name
    )
    assert ok == safe


# --- steps and keys --------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 12, 10**18 - 1])
def test_good_steps(step):
    assert validate_step(step) == step
    assert type(validate_step(step)) is int


@pytest.mark.parametrize("step", [-1, 10**18, True, False, 1.0, "1", None])
def test_bad_steps(step):
    with pytest.raises(InvalidNameError, match="step must be"):
        validate_step(step)


@pytest.mark.parametrize("key", ["objects/ab/cdef", "runs/exp1/checkpoints/12.json", "x"])
def test_good_keys(key):
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "a//b", "a/./b", "a/../b", "..", "a/", "a\\b", "a\x00b", "."]
)
def test_bad_keys(key):
    with pytest.raises(InvalidNameError, match="unsafe storage key"):
        check_key(key)


# --- checkpoint references -------------------------------------------------------------------


def test_parse_ref_forms():
    assert parse_ref("exp1@12") == ("exp1", 12)
    assert parse_ref("exp1@0") == ("exp1", 0)
    assert parse_ref("exp1@latest") == ("exp1", "latest")
    assert parse_ref("exp1") == ("exp1", None)
    assert parse_ref("llama-7b.v2@999999999999999999") == ("llama-7b.v2", 10**18 - 1)
    assert type(parse_ref("exp1@007")[1]) is int and parse_ref("exp1@007")[1] == 7


@pytest.mark.parametrize(
    "ref",
    [
        "",
        None,
        "@12",
        "exp1@",
        "exp1@-1",
        "exp1@abc",
        "exp1@LATEST",
        "exp1@1@2",
        "exp1@1.5",
        "exp1@1234567890123456789",  # 19 digits
        "../x@1",
        "a/b@latest",
        "..",
        ".hidden@3",
        "exp1\n",
        "exp 1@3",
    ],
)
def test_bad_refs(ref):
    with pytest.raises(InvalidNameError):
        parse_ref(ref)
