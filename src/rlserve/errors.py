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
