"""What the frontend processes of one server say to each other: typed messages (msgspec
structs) framed on a local stream socket. The leading frontend owns the lifecycle and the
credentials; every other one takes its credentials from it, says when it serves, asks it to
admit each request (held while paused, its LoRA adapter pinned), says when the engine has it
and when it ended, passes on the scheduler figures the engine sent it, and hears aborts and
whether inference serves. No grpc, no engine.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

from rlserve import errors
from rlserve.types import LoraAdapter

FRAME = struct.Struct("!I")
MAX_FRAME_BYTES = 16 << 20


# A following frontend to the leader -------------------------------------------------------


class Hello(msgspec.Struct, tag=True, frozen=True):
    """Frontend `index` (its number, kept across restarts) connected; Credentials follow."""

    index: int
    pid: int


class Ready(msgspec.Struct, tag=True, frozen=True):
    """This frontend serves the inference port now."""


class Admit(msgspec.Struct, tag=True, frozen=True):
    """Admit request `seq` of this frontend (its client's id, for Abort by id)."""

    seq: int
    request_id: str
    num_bytes: int
    lora_name: str = ""


class Entered(msgspec.Struct, tag=True, frozen=True):
    """The engine has request `seq` under `internal_id` ("": submitting it failed)."""

    seq: int
    internal_id: str


class Ended(msgspec.Struct, tag=True, frozen=True):
    """Request `seq` is over (also one the caller left while it was held)."""

    seq: int


class ListLoras(msgspec.Struct, tag=True, frozen=True):
    seq: int


class Record(msgspec.Struct, tag=True, frozen=True):
    """A call this frontend refused (access control), for the one audit log."""

    operation: str
    detail: str
    outcome: str


class Observed(msgspec.Struct, tag=True, frozen=True):
    """An RPC this frontend answered, for the one set of metrics."""

    method: str
    code: str
    seconds: float


class Load(msgspec.Struct, tag=True, frozen=True):
    """Scheduler figures the engine sent this frontend (it sends each step's to one of them)."""

    data_parallel_rank: int
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    unix_time_s: float


# The leader to a following frontend -------------------------------------------------------


class Credentials(msgspec.Struct, tag=True, frozen=True):
    """The bearer tokens in force (a tokens file's text), or None when the server has none:
    first after Hello, then after every reload the leader takes."""

    tokens_text: str | None


class Admitted(msgspec.Struct, tag=True, frozen=True):
    """Go ahead with request `seq` (with this adapter), or end it unrun when `aborted`."""

    seq: int
    aborted: bool = False
    lora: LoraAdapter | None = None


class Refused(msgspec.Struct, tag=True, frozen=True):
    """Request `seq` (an admission or a query) ends with this domain error."""

    seq: int
    kind: str
    message: str


class Loras(msgspec.Struct, tag=True, frozen=True):
    seq: int
    adapters: tuple[LoraAdapter, ...]


class AbortRequests(msgspec.Struct, tag=True, frozen=True):
    """Abort these requests by the clients' ids (or vLLM's internal ids when `internal`)."""

    request_ids: tuple[str, ...]
    internal: bool = False


class Serving(msgspec.Struct, tag=True, frozen=True):
    """Whether vllm.Inference serves (not paused, not asleep): what health reports."""

    is_serving: bool


Message = (
    Hello
    | Ready
    | Load
    | Credentials
    | Admit
    | Entered
    | Ended
    | ListLoras
    | Record
    | Observed
    | Admitted
    | Refused
    | Loras
    | AbortRequests
    | Serving
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(message: Message) -> bytes:
    body = _encoder.encode(message)
    return FRAME.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> Message | None:
    """The next message; None at the end of the stream (the peer is gone)."""
    try:
        header = await reader.readexactly(FRAME.size)
        (size,) = FRAME.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise ConnectionError(f"a frame of {size} bytes from a frontend: the stream is corrupt")
        return _decoder.decode(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None


# Domain errors cross as their family's stable name (`errors.RlserveError.kind`) and their
# message, and come back as an error of the same family (so the same status code).
def refusal(seq: int, error: errors.RlserveError) -> Refused:
    return Refused(seq, error.kind, str(error))


def error_of(refused: Refused) -> errors.RlserveError:
    return errors.of_kind(refused.kind, refused.message)
