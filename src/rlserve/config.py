"""rlserve's configuration: frozen dataclasses built once from the CLI (or by tests).

Validation lives here and raises ValueError with what was wrong; nothing else in rlserve reads
the environment or the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """The vLLM engine options rlserve passes through."""

    model: str
    served_model_name: str = ""
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    data_parallel_size: int = 1
    enforce_eager: bool = False
    weight_transfer_backend: str = ""
    enable_sleep_mode: bool = False
    scheduling_policy: str = "fcfs"
    seed: int = 0
    kv_cache_gib: float | None = None
    extra_engine_args: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: a local HF model directory is required")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request's `model` field may carry; the first is the primary one."""
        primary = self.served_model_name or self.model
        return (primary,) if primary == self.model else (primary, self.model)


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051
    shutdown_grace_s: float = 10.0
    max_message_bytes: int = 64 * 1024 * 1024
    # Generation requests held while paused; more get RESOURCE_EXHAUSTED.
    max_held_requests: int = 4096
    # Default deadline for weight-transfer rendezvous and each transfer step.
    transfer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is out of range 0..65535")
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be positive")
        if self.max_held_requests < 0:
            raise ValueError("max_held_requests must be >= 0")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rlserve"
