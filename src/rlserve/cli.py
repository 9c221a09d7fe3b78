"""`rlserve serve`: parse the command line (and RLSERVE_AUTH_TOKENS) once into a `ServeConfig`
and run the server. Secrets never come from the command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlserve.config import (
    AUTH_TOKENS_ENV,
    DTYPES,
    LOGPROBS_MODES,
    WEIGHT_UPDATE_MODES,
    EngineConfig,
    SecurityConfig,
    ServeConfig,
    default_cache_dir,
)

SECURITY_HELP = """Security: the control plane can pause the server and replace its weights. It may
only listen beyond loopback with authentication: bearer tokens from --auth-tokens-file FILE
(or the same text in the environment variable RLSERVE_AUTH_TOKENS), one `ROLE TOKEN [NAME]`
per line, ROLE `read` or `admin`, `#` starts a comment; clients send `authorization: Bearer
TOKEN`. SIGHUP re-reads the file. Or mutual TLS: --tls-cert-file/--tls-key-file with
--tls-client-ca-file; a client certificate's CN is the caller (grant it a role with a line
`admin cert:CN`, or give it the OU `rlserve-admin` / `rlserve-read`). See docs/security.md."""

SCHEDULING_POLICIES = ("fcfs", "priority")

# The dataclasses own the defaults and the CLI shows them: a flag's default is its field's
# unless the flag gives one.
_FIELD_DEFAULT: Any = object()
# Where a flag's field lives: "engine.NAME" (EngineConfig), "security.NAME" (SecurityConfig),
# or a ServeConfig field's NAME.
_CONFIGS: dict[str, type[EngineConfig] | type[SecurityConfig] | type[ServeConfig]] = {
    "engine": EngineConfig,
    "security": SecurityConfig,
    "": ServeConfig,
}


@dataclass(frozen=True)
class Flag:
    """One `rlserve serve` flag and the config field it sets (`field`: "engine.NAME",
    "security.NAME", a ServeConfig field, or "" for none). `to_field` turns the parsed value
    into the field's; a switch is a store_true flag."""

    name: str
    field: str
    help: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    is_switch: bool = False
    default: Any = _FIELD_DEFAULT
    default_factory: Callable[[], Any] | None = None
    to_field: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def config_and_name(self) -> tuple[str, str]:
        config, _, name = self.field.rpartition(".")
        return config, name

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.is_switch:
            parser.add_argument(self.name, action="store_true", help=self.help)
            return
        options: dict[str, Any] = {"default": self._default(), "help": self.help}
        if self.type is not None:
            options["type"] = self.type
        if self.choices is not None:
            options["choices"] = self.choices
        parser.add_argument(self.name, **options)

    def _default(self) -> Any:
        if self.default_factory is not None:
            return self.default_factory()
        if self.default is not _FIELD_DEFAULT:
            return self.default
        config, name = self.config_and_name
        return _CONFIGS[config].__dataclass_fields__[name].default


def _hosts(text: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in text.split(",") if h.strip())


def _negated(value: bool) -> bool:
    return not value


# `rlserve serve`'s flags in the order --help shows them.
SERVE_FLAGS = (
    Flag("--model", "engine.model", "local HF model directory (default: SmolLM2-135M-Instruct)", default=""),
    Flag("--served-model-name", "engine.served_model_name", "name clients use (default: the model path)"),
    Flag("--host", "host", "bind address (default: loopback only)"),
    Flag("--port", "port", type=int),
    Flag(
        "--control-address",
        "control_address",
        "a listener of its own for vllm.Control and rlserve.v1 (HOST:PORT or unix:PATH); default: --host/--port",
    ),
    Flag(
        "--frontends",
        "num_frontends",
        "frontend processes over the one engine, all serving vllm.Inference on --port (more frontend CPU "
        "for a fast engine); the first owns the control plane, which then needs --control-address",
        type=int,
    ),
    Flag(
        "--max-frontend-restarts",
        "max_frontend_restarts",
        "with --frontends: how often in all a frontend process (not the first) that died is started "
        "again, after a back-off of 1-30 s (default: %(default)s)",
        type=int,
    ),
    Flag("--auth-tokens-file", "security.auth_tokens_file", "ROLE TOKEN [NAME] per line (see below)", type=Path),
    Flag("--tls-cert-file", "security.tls_cert_file", "the server's certificate chain (PEM)", type=Path),
    Flag("--tls-key-file", "security.tls_key_file", "the server's private key (PEM)", type=Path),
    Flag("--tls-client-ca-file", "security.tls_client_ca_file", "require client certificates from this CA", type=Path),
    Flag(
        "--insecure-control",
        "security.insecure_control",
        "serve a non-loopback control plane without authentication (not recommended)",
        is_switch=True,
    ),
    Flag(
        "--transfer-allowed-hosts",
        "security.transfer_allowed_hosts",
        "comma-separated hosts, addresses or CIDRs InitWeightTransferEngine may name, besides "
        "loopback and the caller's own address",
        default="",
        to_field=_hosts,
    ),
    Flag("--dtype", "engine.dtype", choices=DTYPES),
    Flag("--max-model-len", "engine.max_model_len", type=int),
    Flag("--max-num-seqs", "engine.max_num_seqs", type=int),
    Flag("--data-parallel-size", "engine.data_parallel_size", type=int),
    Flag("--enforce-eager", "engine.enforce_eager", is_switch=True),
    Flag(
        "--weight-transfer-backend",
        "engine.weight_transfer_backend",
        "rlserve_gloo (CPU or GPU), rlserve_shm (trainer on this host), or vLLM's nccl, ipc, ...",
    ),
    Flag(
        "--weight-update-mode",
        "engine.weight_update_mode",
        "rlserve_gloo/rlserve_shm: shadow (all or nothing; holds a processed copy of the updated layers "
        "until the commit) or in-place (one layer of extra memory; an update that fails half way leaves the "
        "weights inconsistent)",
        choices=WEIGHT_UPDATE_MODES,
    ),
    Flag("--enable-sleep-mode", "engine.enable_sleep_mode", is_switch=True),
    Flag("--scheduling-policy", "engine.scheduling_policy", choices=SCHEDULING_POLICIES),
    Flag(
        "--logprobs-mode",
        "engine.logprobs_mode",
        "what output logprobs are: raw_logprobs (the model's, before temperature and the other sampling "
        "parameters) or processed_logprobs (those the token was sampled from), or their logits",
        choices=LOGPROBS_MODES,
    ),
    Flag("--kv-cache-gib", "engine.kv_cache_gib", "KV cache size (CPU default: 1 GiB)", type=float),
    # Where the default model is converted to (no field: `--model`'s default is made of it).
    Flag("--cache-dir", "", "converted models live here", type=Path, default_factory=default_cache_dir),
    Flag("--shutdown-grace-s", "shutdown_grace_s", type=float),
    Flag(
        "--exit-with-parent",
        "exit_with_parent",
        "shut down when the process that started this one exits (for launchers, which should name "
        "their pid in RLSERVE_LAUNCHER_PID: a launcher gone before the server looks is then seen)",
        is_switch=True,
    ),
    Flag("--max-held-requests", "max_held_requests", "requests held while paused", type=int),
    Flag("--max-held-bytes", "max_held_bytes", "their estimated size, in all", type=int),
    Flag(
        "--transfer-timeout-s",
        "transfer_timeout_s",
        "cap on every weight-transfer deadline (a trainer's timeout_s may only lower it)",
        type=float,
    ),
    Flag(
        "--update-lease-s",
        "update_lease_s",
        "an update session with no call for this long is aborted (default: the transfer timeout)",
        type=float,
    ),
    Flag(
        "--engine-hang-timeout-s",
        "engine.hang_timeout_s",
        "an engine that answers nothing for this long is declared dead (health NOT_SERVING)",
        type=float,
    ),
    Flag("--max-message-bytes", "max_message_bytes", "largest gRPC message", type=int),
    # Also sets engine.vllm_metrics: vLLM's metrics are recorded only when something scrapes them.
    Flag(
        "--metrics-port",
        "metrics_port",
        "serve Prometheus metrics (rlserve_* and vLLM's vllm:*) at http://HOST:PORT/metrics",
        type=int,
    ),
    Flag("--enable-lora", "engine.enable_lora", "serve LoRA adapters (Control/LoadLora)", is_switch=True),
    Flag("--max-loras", "engine.max_loras", "adapters per batch", type=int),
    Flag("--max-lora-rank", "engine.max_lora_rank", type=int),
    Flag(
        "--disable-log-stats",
        "engine.log_stats",
        "run the engine without scheduler stats: no vllm:* metrics, and GetLoad is refused",
        is_switch=True,
        to_field=_negated,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over gRPC (vllm.Inference, vllm.Control)",
        epilog=SECURITY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag in SERVE_FLAGS:
        flag.add_to(serve)
    from rlserve.rl import demo

    d = sub.add_parser(
        "demo",
        help="train a policy with GRPO through rlserve (starts a server unless --server is given)",
        description=demo.__doc__,
        epilog=f"An authenticated server: the admin token comes from ${demo.TOKEN_ENV}. See docs/rl-loop.md.",
    )
    demo.add_arguments(d)
    return parser


def serve_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeConfig:
    """The configuration `rlserve serve`'s flags (and RLSERVE_AUTH_TOKENS in `environ`, default
    the process's environment) ask for; raises ValueError naming what cannot work."""
    fields: dict[str, dict[str, Any]] = {config: {} for config in _CONFIGS}
    for flag in SERVE_FLAGS:
        if flag.field:
            config, name = flag.config_and_name
            value = getattr(args, flag.dest)
            fields[config][name] = flag.to_field(value) if flag.to_field is not None else value
    engine = fields["engine"]
    if not engine["model"]:
        engine.update(_default_model(args.cache_dir, engine["served_model_name"], engine["dtype"]))
    engine["vllm_metrics"] = args.metrics_port is not None
    environ = dict(os.environ) if environ is None else environ
    fields["security"]["auth_tokens_text"] = environ.get(AUTH_TOKENS_ENV)
    return ServeConfig(engine=EngineConfig(**engine), security=SecurityConfig(**fields["security"]), **fields[""])


def _default_model(cache_dir: Path, served_name: str, dtype: str) -> dict[str, Any]:
    """The engine fields of the default model, converted (once) by the server after it binds,
    so health answers meanwhile."""
    from rlserve.model_cache import DEFAULT_MODEL_NAME

    return {
        "model": str(cache_dir / "models" / DEFAULT_MODEL_NAME),
        "served_model_name": served_name or DEFAULT_MODEL_NAME,
        # bf16 rounding flips near-ties of this small model on CPU; fp32 is as fast here.
        "dtype": "float32" if dtype == "auto" else dtype,
        "is_default_model": True,
    }


def model_misfit(engine: EngineConfig) -> str:
    """Why `--model` cannot be served, in one line ("" when it can): rlserve serves a local
    Hugging Face model directory (vLLM would take a missing path for a hub repo id)."""
    if engine.is_default_model:
        return ""  # converted by the server once it listens
    path = Path(engine.model)
    if not path.is_dir():
        return f"--model {engine.model}: no such directory (give a local Hugging Face model directory)"
    if not (path / "config.json").is_file():
        return f"--model {engine.model}: no config.json there: not a Hugging Face model directory"
    return ""


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if args.trainer == "trl":
            from rlserve.integrations.trl import demo as trl_demo

            return trl_demo.run(args)
        from rlserve.rl import demo

        return demo.run(args)
    try:
        config = serve_config(args)
    except ValueError as e:
        print(f"rlserve: {e}", file=sys.stderr)
        return 2
    problem = model_misfit(config.engine)
    if problem:
        print(f"rlserve: {problem}", file=sys.stderr)
        return 2
    metrics_directory = None
    if config.num_frontends > 1 and config.metrics_port is not None:
        from rlserve.frontends.prometheus import use_multiprocess_metrics

        metrics_directory = use_multiprocess_metrics()  # before anything imports prometheus_client
    import uvloop

    from rlserve.server.app import serve
    from rlserve.server.listeners import AddressInUse

    try:
        # uvloop (a vLLM dependency) costs grpc.aio ~20 µs less CPU per streamed message.
        uvloop.run(serve(config))
    except AddressInUse as e:
        print(f"rlserve: {e}", file=sys.stderr)
        return 2
    finally:
        if metrics_directory is not None:
            metrics_directory.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
