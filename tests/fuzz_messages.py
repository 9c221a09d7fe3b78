"""Hypothesis strategies for any protobuf request message, built from its descriptor: random
and boundary values for every field, huge strings and repeated fields, invalid UTF-8 in
bytes, unknown enum values, and for the JSON payload fields, malformed and deeply nested
JSON mixed with well-formed objects that use the keys the server knows; native sampling params
are drawn from vLLM's own SamplingParams schema (every field, typed as vLLM declares it), so a
field vLLM adds is fuzzed without anyone listing it."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from typing import Any

from google.protobuf import descriptor as d
from hypothesis import strategies as st

# Strategies are built once (functools.cache) and drawn from many times: built anew for every
# draw, building and validating them was half of what the fuzz tests spent.
FD = d.FieldDescriptor
INTS = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
# Keys the server reads in each JSON payload, so that generated objects get past "unknown key".
JSON_KEYS = {
    "init_info_json": ["master_address", "master_port", "rank_offset", "world_size", "timeout_s"],
    "update_info_json": ["names", "dtype_names", "shapes", "checksums", "bucket_bytes", "messages"],
}


@functools.cache
def small_ints() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-3, 64), st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**53, -(2**31)]))


@functools.cache
def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        small_ints(),
        st.integers(-(2**80), 2**80),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=max_leaves,
    )


# Fields whose values decide how long one example runs: kept small (and some past any limit).
BOUNDED_NATIVE = {
    "max_tokens": st.one_of(st.integers(-2, 16), st.sampled_from([0, 2**31, 10**9])),
    "n": st.one_of(st.integers(-2, 4), st.sampled_from([0, 2**31])),
}


def from_annotation(tp: Any) -> st.SearchStrategy[Any]:
    """JSON values of the type `tp` (as a SamplingParams field declares it), with boundaries."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return st.none()
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(from_annotation(a) for a in args))
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(small_ints(), st.sampled_from([-1, 2**63 - 1, 2**63, -(2**63), 2**64]))
    if tp is float:
        return st.one_of(
            st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -1.0, 1.0, 1e-30, 1e30])
        )
    if tp is str:
        return st.one_of(st.text(max_size=12), st.sampled_from(["", "\x00", "x" * 500]))
    if origin in (list, set, frozenset, tuple):
        item = from_annotation(args[0]) if args else json_values()
        return st.one_of(st.lists(item, max_size=5), st.just([]))
    if origin is dict:
        key = st.one_of(small_ints().map(str), st.text(max_size=6))  # JSON keys are strings
        return st.dictionaries(key, from_annotation(args[1]) if args else json_values(), max_size=4)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.one_of(st.sampled_from([m.value for m in tp]), st.integers(-2, 9))
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: from_annotation(hints[f.name]) for f in dataclasses.fields(tp)}
        return st.fixed_dictionaries({}, optional=fields)
    return json_values()  # Any, numpy arrays, what JSON cannot spell exactly


@functools.cache
def native_sampling_params() -> st.SearchStrategy[dict[str, Any]]:
    """Objects of one to four SamplingParams fields, every field (private ones included: a
    client may send them), each valued by its declared type."""
    from vllm import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    by_field = {
        name: BOUNDED_NATIVE.get(name) or from_annotation(hints[name]) for name in SamplingParams.__struct_fields__
    }
    keys = st.lists(st.sampled_from(sorted(by_field)), min_size=1, max_size=4, unique=True)
    return keys.flatmap(lambda chosen: st.fixed_dictionaries({k: by_field[k] for k in chosen}))


@functools.cache
def json_payload(field: str) -> st.SearchStrategy[bytes]:
    keys = JSON_KEYS.get(field, [])
    known = st.dictionaries(st.sampled_from(keys), json_values(), max_size=len(keys)) if keys else st.just({})
    if field == "native_sampling_params_json":
        known = native_sampling_params()
    objects = st.one_of(known, st.dictionaries(st.text(max_size=12), json_values(), max_size=4), json_values())
    encoded = objects.map(lambda v: json.dumps(v).encode())
    garbage = st.one_of(
        st.binary(max_size=64),
        st.sampled_from(
            [b"", b"{", b"[" * 5000 + b"]" * 5000, b'{"a": NaN}', b'{"a": Infinity}', b"\xff\xfe{}", b"null"]
        ),
    )
    return st.one_of(encoded, encoded, garbage)


@functools.cache
def huge_text() -> st.SearchStrategy[str]:
    """2000-3000 characters: a drawn piece repeated. Hypothesis draws text a character at a
    time: 2000-3000 drawn characters per huge string were 11 s of the 51 s that 1000 examples
    of test_fuzz_generate_request_conversion took here (0.1 s of it converting)."""
    return st.builds(
        lambda piece, n: (piece * (n // len(piece) + 1))[:n], st.text(min_size=1, max_size=40), st.integers(2000, 3000)
    )


@functools.cache
def scalar(field: d.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in INTS:
        low, high = INTS[t]
        return st.one_of(
            st.integers(low, high), st.sampled_from([low, high, 0, 1]), small_ints().filter(lambda v: low <= v <= high)
        )
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.one_of(
            st.floats(width=32 if t == FD.TYPE_FLOAT else 64),
            st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e38, 1e-45]),
        )
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return st.one_of(
            st.text(max_size=40),
            st.sampled_from(["", "x" * 300, "é" * 200, "\x00"]),
            huge_text(),
        )
    if t == FD.TYPE_BYTES:
        if field.name in JSON_KEYS or field.name.endswith("_json"):
            return json_payload(field.name)
        return st.binary(max_size=64)
    if t == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 100))
    raise TypeError(f"no strategy for field type {t}")


@st.composite
def messages(draw, cls: type, depth: int = 0) -> Any:
    """An instance of the protobuf message class `cls`, every field set or left out."""
    msg = cls()
    desc = cls.DESCRIPTOR
    for oneof in desc.oneofs:
        fields = list(oneof.fields)
        chosen = draw(st.sampled_from([None, *fields]))
        if chosen is not None:
            _set(draw, msg, chosen, depth)
    for field in desc.fields:
        if field.containing_oneof is not None or not draw(st.booleans()):
            continue
        _set(draw, msg, field, depth)
    return msg


def _set(draw, msg: Any, field: d.FieldDescriptor, depth: int) -> None:
    is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
    if is_map:
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        target = getattr(msg, field.name)
        if draw(st.integers(0, 9)) == 0 and key_field.type in INTS:  # huge: past any limit
            value = draw(scalar(value_field))
            for k in range(5000):
                target[k] = value
            return
        for k in draw(st.lists(scalar(key_field), max_size=4)):
            target[k] = draw(scalar(value_field))
        return
    if field.message_type is not None:
        sub = field.message_type._concrete_class
        if field.message_type.full_name == "google.protobuf.Struct":
            getattr(msg, field.name).update(draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)))
            return
        if depth >= 3:
            return
        if field.is_repeated:
            for value in draw(st.lists(messages(sub, depth + 1), max_size=3)):
                getattr(msg, field.name).add().CopyFrom(value)
        else:
            getattr(msg, field.name).CopyFrom(draw(messages(sub, depth + 1)))
        return
    if field.is_repeated:
        if draw(st.integers(0, 9)) == 0:  # huge: past any limit
            values = [draw(scalar(field))] * (100 if field.type == FD.TYPE_STRING else 300_000)
        else:
            values = draw(st.lists(scalar(field), max_size=6))
        getattr(msg, field.name).extend(values)
        return
    setattr(msg, field.name, draw(scalar(field)))
