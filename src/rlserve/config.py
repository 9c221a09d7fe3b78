"""rlserve's configuration: frozen dataclasses built once from the CLI (or by tests).

Validation lives here and raises ValueError with what was wrong; nothing else in rlserve reads
the environment or the command line.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's logprobs_mode: what a sampled token's logprob is. "raw_*" come from the model's
# logits before any sampling parameter; "processed_*" after temperature, penalties and
# top-k/top-p/min-p, i.e. the distribution the token was sampled from (what importance
# sampling against the trainer needs whenever temperature != 1).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# How rlserve's backends commit: beside the served model (shadows) or layer by layer into it.
WEIGHT_UPDATE_MODES = ("shadow", "in-place")
# `rlserve serve` reads its bearer tokens from here (a secret: never on a command line).
AUTH_TOKENS_ENV = "RLSERVE_AUTH_TOKENS"


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
    # rlserve_gloo / rlserve_shm: "shadow" (all or nothing, one processed copy of the updated
    # layers until the commit) or "in-place" (one layer of extra memory; a failure half way
    # leaves the weights inconsistent). vLLM's own backends are always in place.
    weight_update_mode: str = "shadow"
    enable_sleep_mode: bool = False
    scheduling_policy: str = "fcfs"
    seed: int = 0
    kv_cache_gib: float | None = None
    # An engine that answers nothing for this long is declared dead (health NOT_SERVING);
    # set it above the longest engine step the model and batch limits allow.
    hang_timeout_s: float = 60.0
    # vLLM's scheduler stats: the figures of `GetLoad` and vLLM's own `vllm:` metrics.
    log_stats: bool = True
    # vLLM's Prometheus metrics (`vllm:*`), only worth their CPU when something scrapes them.
    vllm_metrics: bool = False
    # LoRA adapters: off unless enabled; max_loras adapters per batch, up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # What output logprobs are (LOGPROBS_MODES), as vLLM's --logprobs-mode.
    logprobs_mode: str = "raw_logprobs"
    # `model` is where the default model is converted to; the server converts it if needed.
    is_default_model: bool = False
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
        if self.weight_update_mode not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"weight_update_mode: {self.weight_update_mode!r} is not one of {WEIGHT_UPDATE_MODES}")
        if self.hang_timeout_s <= 0:
            raise ValueError("hang_timeout_s must be positive")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: {self.logprobs_mode!r} is not one of {LOGPROBS_MODES}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request's `model` field may carry; the first is the primary one."""
        primary = self.served_model_name or self.model
        return (primary,) if primary == self.model else (primary, self.model)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry. A breach is refused with INVALID_ARGUMENT naming the field
    and the limit; each bound keeps one request from costing the server seconds or memory."""

    max_prompt_text_bytes: int = 1 << 20
    # Before truncate_prompt_tokens; the model's context bounds what is left after it.
    max_prompt_token_ids: int = 1 << 18
    max_stop_strings: int = 64
    max_stop_string_bytes: int = 1024
    # stop_token_ids, allowed_token_ids, candidate token ids.
    max_token_id_list: int = 1 << 16
    max_logit_bias_entries: int = 4096
    max_choices: int = 1024
    # A JSON schema, regex, grammar or structural tag (compiled by the engine), or all choices.
    max_structured_spec_bytes: int = 1 << 16
    max_native_json_bytes: int = 1 << 16
    max_num_sequences: int = 64
    # request_id, model, cache_salt, each Abort id.
    max_id_bytes: int = 256
    max_abort_ids: int = 4096
    # init_info_json / update_info_json of the weight-transfer RPCs.
    max_transfer_info_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive")


DEFAULT_TRANSFER_TIMEOUT_S = 60.0
# A chunk's deadline grows with its size: the transfer timeout per started 256 MiB.
BYTES_PER_TIMEOUT = 256 * 2**20


def chunk_deadline_s(timeout_s: float, num_bytes: int) -> float:
    """How long a step that moves `num_bytes` may take (the trainer, the server and its
    workers agree on it): `timeout_s` per started 256 MiB."""
    return timeout_s * (1 + num_bytes // BYTES_PER_TIMEOUT)


@dataclass(frozen=True)
class SecurityConfig:
    """Authentication and transport security of the listeners (see docs/security.md)."""

    auth_tokens_file: Path | None = None
    # The same text as a tokens file, taken from RLSERVE_AUTH_TOKENS by the CLI; never shown.
    auth_tokens_text: str | None = field(default=None, repr=False)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Client certificates signed by this CA are required (mutual TLS).
    tls_client_ca_file: Path | None = None
    # Serve a non-loopback control listener without authentication anyway.
    insecure_control: bool = False
    # Where InitWeightTransferEngine may make the workers connect, besides loopback and the
    # caller's own address: host names, addresses or CIDR blocks.
    transfer_allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.auth_tokens_file is not None and self.auth_tokens_text is not None:
            raise ValueError("auth tokens: give a tokens file or RLSERVE_AUTH_TOKENS, not both")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls: give --tls-cert-file and --tls-key-file together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls: --tls-client-ca-file needs --tls-cert-file and --tls-key-file")

    @property
    def has_tokens(self) -> bool:
        return self.auth_tokens_file is not None or self.auth_tokens_text is not None

    @property
    def auth_enabled(self) -> bool:
        """Every RPC but health and reflection then needs a credential."""
        return self.has_tokens or self.tls_client_ca_file is not None


def is_loopback(address: str) -> bool:
    """Whether `host:port`, `[v6]:port` or `unix:PATH` can only be reached from this host."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051
    shutdown_grace_s: float = 10.0
    max_message_bytes: int = 16 * 1024 * 1024
    # HTTP/2 streams one connection may have open at once; more wait for a free one.
    max_concurrent_streams: int = 1024
    # Generation requests held while paused, by count and by prompt bytes; more get
    # RESOURCE_EXHAUSTED.
    max_held_requests: int = 4096
    max_held_bytes: int = 1 << 30
    # The cap on every weight-transfer deadline (rendezvous, each chunk, commit) and the idle
    # lease of an update session; a caller's timeout_s may only lower it.
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    # The idle lease of an open update session (None: transfer_timeout_s): a session that
    # sees no call for this long is aborted, so a trainer that died cannot pause the server.
    update_lease_s: float | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    # A listener of its own for the control plane (vllm.Control, rlserve.v1.*): `host:port`
    # or `unix:PATH`. Empty: the control plane shares the inference listener.
    control_address: str = ""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # Prometheus `/metrics` over HTTP on `host` (None: not served; 0: any free port).
    metrics_port: int | None = None
    # Shut down (gracefully, as on SIGTERM) when the process that started the server exits:
    # a server started by a launcher (a Ray actor) does not outlive it.
    exit_with_parent: bool = False
    # Frontend processes over the one engine (vLLM's --api-server-count): all serve
    # vllm.Inference on `address`; the first owns the lifecycle and the control plane, which
    # then needs a listener of its own (control_address).
    num_frontends: int = 1
    # A frontend process (not the first) that dies is started again, at most this many times
    # over the server's life (each restart takes one of as many spare engine socket pairs).
    max_frontend_restarts: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is out of range 0..65535")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: {self.metrics_port} is out of range 0..65535")
        for name in ("transfer_timeout_s", "max_message_bytes", "max_held_bytes", "max_concurrent_streams"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.update_lease_s is not None and self.update_lease_s <= 0:
            raise ValueError("update_lease_s must be positive")
        if self.max_held_requests < 0:
            raise ValueError("max_held_requests must be >= 0")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if self.num_frontends < 1:
            raise ValueError("num_frontends must be >= 1")
        if self.max_frontend_restarts < 0:
            raise ValueError("max_frontend_restarts must be >= 0")
        if self.num_frontends > 1 and not self.control_address:
            raise ValueError(
                "--frontends > 1 serves the control plane from one process: give it a listener of its own "
                "(--control-address HOST:PORT or unix:PATH)"
            )
        control = self.control_address or self.address
        if not is_loopback(control) and not self.security.auth_enabled and not self.security.insecure_control:
            raise ValueError(
                f"the control plane would listen on {control} without authentication: give auth tokens "
                "(--auth-tokens-file or RLSERVE_AUTH_TOKENS) or client certificates (--tls-client-ca-file), "
                "serve it on loopback (--control-address 127.0.0.1:PORT), or pass --insecure-control"
            )

    @property
    def address(self) -> str:
        """The inference listener (and the control plane's, unless it has its own)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def lease_s(self) -> float:
        return self.update_lease_s if self.update_lease_s is not None else self.transfer_timeout_s


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "rlserve"


# The vLLM minor rlserve is written against (pyproject pins it); each process side's
# `vllm_compat` module refuses another one at import, naming its reaches into vLLM.
VLLM_PINNED_MINOR = (0, 32)


def check_vllm_version(version: str, reaches: tuple[str, ...], other_side: str) -> None:
    """Raises RuntimeError unless `version` is of `VLLM_PINNED_MINOR`; the message names
    `reaches` to re-check, and the `other_side` module with its own."""
    try:
        minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        minor = ()
    if minor != VLLM_PINNED_MINOR:
        pinned = ".".join(map(str, VLLM_PINNED_MINOR))
        raise RuntimeError(
            f"rlserve is written against vLLM {pinned}.x, this is vLLM {version}: re-check every reach "
            f"into its internals before changing the pin ({'; '.join(reaches)}), and those of {other_side}"
        )
