"""Domain errors of rlserve, named for the condition, never for a status code.

Raised by the engine adapter and the lifecycle controller; `rlserve.server.errors` maps each
class to a gRPC status in one table. Nothing here imports grpc, torch or vllm.
"""

from __future__ import annotations


class RlserveError(Exception):
    """Base of every error rlserve reports to a client."""


class InvalidRequest(RlserveError):
    """Malformed or unsupported input; `field` names the offending request field."""

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


class EngineUnavailable(RlserveError):
    """The engine is starting, shutting down or dead; retrying later may succeed."""


class Overloaded(RlserveError):
    """A queue or admission limit was hit."""


class WrongState(RlserveError):
    """The lifecycle state does not allow this call now; the message says what to do."""


class MemoryAsleep(WrongState):
    pass


class WeightsInconsistent(WrongState):
    pass


class ConcurrentChange(RlserveError):
    """Another control call changed the state first; re-read the state and retry."""


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


class NotAllowed(RlserveError):
    """The caller may not do this: a policy of this server, not a missing role."""


class CommitFailed(RlserveError):
    """Loading staged weights into the model failed half way; the served weights are then
    inconsistent until a complete update succeeds. Not a client mistake: INTERNAL."""


class PrepareFailed(RlserveError):
    """Preparing a commit (PrepareWeightUpdate) failed; the session was dropped and a staging
    backend's served weights are unchanged. Not a client mistake: INTERNAL."""


class NotFound(RlserveError):
    """The named thing (a LoRA adapter) does not exist here."""


class NameTaken(ConcurrentChange):
    """A name already stands for other content (a LoRA adapter); unload it first."""
