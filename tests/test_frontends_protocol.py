"""The frontend processes' messages (no engine): every message survives the stream, a domain
error comes back as an error with the same status code, and a corrupt or cut stream ends
the link instead of being read as messages."""

from __future__ import annotations

import asyncio

import grpc
import msgspec
import pytest

from rlserve import errors
from rlserve.frontends import protocol as p
from rlserve.server.errors import STATUS_BY_KIND, status_for
from rlserve.types import LoraAdapter

ADAPTER = LoraAdapter(3, "policy", "/adapters/policy", digest="abc", version="step-2")
MESSAGES = [
    p.Hello(1, 4242),
    p.Ready(),
    p.Load(0, 3, 1, 0.25, 1796300000.5),
    p.Credentials("read token-0123456789abcdef dashboard\n"),
    p.Credentials(None),
    p.Admit(7, "req-1", 120, "policy"),
    p.Entered(7, "req-1-0a1b"),
    p.Ended(7),
    p.ListLoras(8),
    p.Record("ResumeGeneration", "not served here", "PERMISSION_DENIED"),
    p.Observed("/vllm.Inference/Generate", "OK", 0.25),
    p.Admitted(7, aborted=False, lora=ADAPTER),
    p.Admitted(9, aborted=True),
    p.Refused(10, "overloaded", "too many held"),
    p.Loras(8, (ADAPTER,)),
    p.AbortRequests(("a", "b")),
    p.Serving(False),
]


def stream_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_every_message_survives_the_stream():
    reader = stream_of(b"".join(p.frame(m) for m in MESSAGES))
    got = [await p.read_message(reader) for _ in MESSAGES]
    assert got == MESSAGES
    assert await p.read_message(reader) is None


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidRequest("lora_name", "no adapter 'x' is loaded; LoadLora it first"),
        errors.TooManyHeldRequests(4),
        errors.Overloaded("held bytes"),
        errors.EngineUnavailable("the engine died"),
        errors.NotFound("no adapter"),
        errors.WrongState("paused"),
        errors.CapabilityMissing("no LoRA"),
        errors.VersionMismatch("a", "b"),
        # These two had no row in the frontends' own table and came back UNAVAILABLE.
        errors.TransferTimeout("the trainer vanished"),
        errors.NotAllowed("not on this server"),
    ],
)
def test_a_refusal_comes_back_with_the_same_status_and_message(error):
    back = p.error_of(p.refusal(1, error))
    assert status_for(back) == status_for(error)
    assert str(back) == str(error)


def test_a_bug_in_admission_is_internal_at_the_client():
    back = p.error_of(p.Refused(1, errors.RlserveError.kind, "admission failed: KeyError: 3"))
    assert status_for(back) == grpc.StatusCode.INTERNAL


ERROR_CLASSES = sorted(
    (c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.RlserveError)),
    key=lambda c: c.__name__,
)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_has_a_status_and_crosses_between_frontends(cls):
    """One stable name per family keys both tables: a class added to `errors` gets its
    family's status on every frontend, never a default."""
    assert cls.kind in STATUS_BY_KIND, f"{cls.__name__}: no status for kind {cls.kind!r}"
    back = errors.of_kind(cls.kind, "message")
    assert back.kind == cls.kind and str(back) == "message"
    assert status_for(back) == STATUS_BY_KIND[cls.kind]


def test_every_status_row_is_a_family():
    assert set(STATUS_BY_KIND) == set(errors.KINDS) | {errors.RlserveError.kind}


async def test_a_cut_stream_ends_the_link():
    whole = p.frame(p.Admit(1, "r", 10))
    assert await p.read_message(stream_of(whole[:-3])) is None
    assert await p.read_message(stream_of(whole[:2])) is None


async def test_a_corrupt_stream_is_refused_not_read():
    with pytest.raises(ConnectionError):
        await p.read_message(stream_of(p.FRAME.pack(p.MAX_FRAME_BYTES + 1) + b"x", eof=False))
    with pytest.raises(msgspec.DecodeError):
        await p.read_message(stream_of(p.FRAME.pack(3) + b"\xc1\xc1\xc1"))
