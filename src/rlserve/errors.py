"""Domain errors of rlserve, named for the condition, never for a status code.

Raised by the engine adapter and the lifecycle controller. Each family of errors has one
stable name, its `kind`, which its subclasses share: `rlserve.server.errors` maps each kind to
a gRPC status, and the follower frontends send an error to frontend 0 as its kind and message
(`rlserve.frontends.protocol`), so both tables are keyed on the same names. Nothing here
imports grpc, torch or vllm.
"""

from __future__ import annotations

from typing import ClassVar

# kind -> the family's class, filled as the classes are defined.
KINDS: dict[str, type[RlserveError]] = {}


class RlserveError(Exception):
    """Base of every error rlserve reports to a client. A bare one (or a family without a
    kind of its own) is a bug in rlserve: INTERNAL at the client."""

    kind: ClassVar[str] = "internal"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            if cls.kind in KINDS:
                raise TypeError(f"two error families named {cls.kind!r}: {KINDS[cls.kind].__name__}, {cls.__name__}")
            KINDS[cls.kind] = cls


def of_kind(kind: str, message: str) -> RlserveError:
    """An error of the family `kind` (as `error.kind` named it elsewhere) with `message`; an
    unknown kind is a bug, as in the process that raised it."""
    cls = KINDS.get(kind, RlserveError)
    if cls is InvalidRequest:
        return InvalidRequest("", message)  # the message names the field
    return cls(message)


class InvalidRequest(RlserveError):
    """Malformed or unsupported input; `field` names the offending request field."""

    kind = "invalid"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class LimitExceeded(InvalidRequest):
    """A field larger than the server's configured bound for it."""

    def __init__(self, field: str, size: int, unit: str, limit_name: str, limit: int) -> None:
        super().__init__(field, f"has {size} {unit}, more than this server's {limit_name}={limit}")
        self.limit_name = limit_name


class UnknownModel(InvalidRequest):
    def __init__(self, model: str, served: tuple[str, ...]) -> None:
        super().__init__("model", f"unknown model {model!r}; this server serves {list(served)}")


class PromptTooLong(InvalidRequest):
    def __init__(self, num_tokens: int, limit: int) -> None:
        super().__init__(
            "prompt",
            f"prompt has {num_tokens} tokens, the model allows at most {limit}; "
            "shorten it or set truncate_prompt_tokens",
        )


class CapabilityMissing(RlserveError):
    """A feature this server was not configured for (fail closed)."""

    kind = "capability"


class EngineUnavailable(RlserveError):
    """The engine is starting, shutting down or dead; retrying later may succeed."""

    kind = "unavailable"


class Overloaded(RlserveError):
    """A queue or admission limit was hit."""

    kind = "overloaded"


class WrongState(RlserveError):
    """The lifecycle state does not allow this call now; the message says what to do."""

    kind = "wrong_state"


class MemoryAsleep(WrongState):
    pass


class WeightsInconsistent(WrongState):
    pass


class ConcurrentChange(RlserveError):
    """Another control call changed the state first; re-read the state and retry."""

    kind = "conflict"


class StaleBase(ConcurrentChange):
    """A patch builds on a weight version the server does not serve; send a whole update, or
    a patch on the version it serves. Nothing changed."""


class VersionMismatch(ConcurrentChange):
    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"weight version is {actual!r}, not the expected {expected!r}; nothing changed")


class PauseDraining(ConcurrentChange):
    """A WAIT pause has not drained yet; the engine cannot be resumed in the middle of it."""


class TooManyHeldRequests(Overloaded):
    def __init__(self, limit: int) -> None:
        super().__init__(f"generation is paused and {limit} requests are already held; retry after resume")


class NotPaused(WrongState):
    pass


class NoUpdateSession(WrongState):
    pass


class TransportNotReady(WrongState):
    pass


class UpdateInProgress(ConcurrentChange):
    pass


class TransferTimeout(RlserveError):
    """A rendezvous or transfer with the trainer ran out of time (or the trainer vanished)."""

    kind = "transfer_timeout"


class NotAllowed(RlserveError):
    """The caller may not do this: a policy of this server, not a missing role."""

    kind = "not_allowed"


class CommitFailed(RlserveError):
    """Loading staged weights into the model failed half way; the served weights are then
    inconsistent until a complete update succeeds. Not a client mistake: INTERNAL."""

    kind = "commit_failed"


class PrepareFailed(RlserveError):
    """Preparing a commit (PrepareWeightUpdate) failed; the session was dropped and a staging
    backend's served weights are unchanged. Not a client mistake: INTERNAL."""

    kind = "prepare_failed"


class NotFound(RlserveError):
    """The named thing (a LoRA adapter) does not exist here."""

    kind = "not_found"


class NameTaken(ConcurrentChange):
    """A name already stands for other content (a LoRA adapter); unload it first."""
