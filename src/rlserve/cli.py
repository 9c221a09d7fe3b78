"""`rlserve serve`: parse the command line (and RLSERVE_AUTH_TOKENS) once into a `ServeConfig`
and run the server. Secrets never come from the command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rlserve.config import (
    AUTH_TOKENS_ENV,
    DTYPES,
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

# The dataclasses own the defaults; the CLI shows them.
_ENGINE = EngineConfig.__dataclass_fields__
_SERVE = ServeConfig.__dataclass_fields__


def _default(fields: dict, name: str) -> object:
    return fields[name].default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="serve a model over gRPC (vllm.Inference, vllm.Control)",
        epilog=SECURITY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--model", default="", help="local HF model directory (default: SmolLM2-135M-Instruct)")
    s.add_argument("--served-model-name", default="", help="name clients use (default: the model path)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument(
        "--control-address",
        default="",
        help="a listener of its own for vllm.Control and rlserve.v1 (HOST:PORT or unix:PATH); default: --host/--port",
    )
    s.add_argument(
        "--frontends",
        type=int,
        default=_default(_SERVE, "num_frontends"),
        help="frontend processes over the one engine, all serving vllm.Inference on --port (more frontend CPU "
        "for a fast engine); the first owns the control plane, which then needs --control-address",
    )
    s.add_argument(
        "--max-frontend-restarts",
        type=int,
        default=_default(_SERVE, "max_frontend_restarts"),
        help="with --frontends: how often in all a frontend process (not the first) that died is started "
        "again, after a back-off of 1-30 s (default: %(default)s)",
    )
    s.add_argument("--auth-tokens-file", type=Path, default=None, help="ROLE TOKEN [NAME] per line (see below)")
    s.add_argument("--tls-cert-file", type=Path, default=None, help="the server's certificate chain (PEM)")
    s.add_argument("--tls-key-file", type=Path, default=None, help="the server's private key (PEM)")
    s.add_argument("--tls-client-ca-file", type=Path, default=None, help="require client certificates from this CA")
    s.add_argument(
        "--insecure-control",
        action="store_true",
        help="serve a non-loopback control plane without authentication (not recommended)",
    )
    s.add_argument(
        "--transfer-allowed-hosts",
        default="",
        help="comma-separated hosts, addresses or CIDRs InitWeightTransferEngine may name, besides "
        "loopback and the caller's own address",
    )
    s.add_argument("--dtype", default="auto", choices=DTYPES)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--data-parallel-size", type=int, default=1)
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument(
        "--weight-transfer-backend",
        default="",
        help="rlserve_gloo (CPU or GPU), rlserve_shm (trainer on this host), or vLLM's nccl, ipc, ...",
    )
    s.add_argument(
        "--weight-update-mode",
        default=_default(_ENGINE, "weight_update_mode"),
        choices=WEIGHT_UPDATE_MODES,
        help="rlserve_gloo/rlserve_shm: shadow (all or nothing; holds a processed copy of the updated layers "
        "until the commit) or in-place (one layer of extra memory; an update that fails half way leaves the "
        "weights inconsistent)",
    )
    s.add_argument("--enable-sleep-mode", action="store_true")
    s.add_argument("--scheduling-policy", default=_default(_ENGINE, "scheduling_policy"), choices=("fcfs", "priority"))
    s.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (CPU default: 1 GiB)")
    s.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="converted models live here")
    s.add_argument("--shutdown-grace-s", type=float, default=_default(_SERVE, "shutdown_grace_s"))
    s.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="shut down when the process that started this one exits (for launchers)",
    )
    s.add_argument(
        "--max-held-requests",
        type=int,
        default=_default(_SERVE, "max_held_requests"),
        help="requests held while paused",
    )
    s.add_argument(
        "--max-held-bytes", type=int, default=_default(_SERVE, "max_held_bytes"), help="their estimated size, in all"
    )
    s.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=_default(_SERVE, "transfer_timeout_s"),
        help="cap on every weight-transfer deadline (a trainer's timeout_s may only lower it)",
    )
    s.add_argument(
        "--update-lease-s",
        type=float,
        default=None,
        help="an update session with no call for this long is aborted (default: the transfer timeout)",
    )
    s.add_argument(
        "--engine-hang-timeout-s",
        type=float,
        default=_default(_ENGINE, "hang_timeout_s"),
        help="an engine that answers nothing for this long is declared dead (health NOT_SERVING)",
    )
    s.add_argument(
        "--max-message-bytes", type=int, default=_default(_SERVE, "max_message_bytes"), help="largest gRPC message"
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (rlserve_* and vLLM's vllm:*) at http://HOST:PORT/metrics",
    )
    s.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (Control/LoadLora)")
    s.add_argument("--max-loras", type=int, default=_default(_ENGINE, "max_loras"), help="adapters per batch")
    s.add_argument("--max-lora-rank", type=int, default=_default(_ENGINE, "max_lora_rank"))
    s.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="run the engine without scheduler stats: no vllm:* metrics, and GetLoad is refused",
    )
    from rlserve.rl import demo

    d = sub.add_parser(
        "demo",
        help="train a policy with GRPO through rlserve (starts a server unless --server is given)",
        description=demo.__doc__,
        epilog=f"An authenticated server: the admin token comes from ${demo.TOKEN_ENV}. See docs/rl-loop.md.",
    )
    demo.add_arguments(d)
    return parser


def security_config(args: argparse.Namespace, environ: dict[str, str]) -> SecurityConfig:
    return SecurityConfig(
        auth_tokens_file=args.auth_tokens_file,
        auth_tokens_text=environ.get(AUTH_TOKENS_ENV),
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_client_ca_file=args.tls_client_ca_file,
        insecure_control=args.insecure_control,
        transfer_allowed_hosts=tuple(h.strip() for h in args.transfer_allowed_hosts.split(",") if h.strip()),
    )


def serve_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeConfig:
    model, served_name, dtype = args.model, args.served_model_name, args.dtype
    is_default_model = not model
    if is_default_model:
        from rlserve.model_cache import DEFAULT_MODEL_NAME

        # Converted (once) by the server after it binds, so health answers meanwhile.
        model = str(args.cache_dir / "models" / DEFAULT_MODEL_NAME)
        served_name = served_name or DEFAULT_MODEL_NAME
        # bf16 rounding flips near-ties of this small model on CPU; fp32 is as fast here.
        dtype = "float32" if args.dtype == "auto" else args.dtype
    engine = EngineConfig(
        model=model,
        served_model_name=served_name,
        dtype=dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        data_parallel_size=args.data_parallel_size,
        enforce_eager=args.enforce_eager,
        weight_transfer_backend=args.weight_transfer_backend,
        weight_update_mode=args.weight_update_mode,
        enable_sleep_mode=args.enable_sleep_mode,
        scheduling_policy=args.scheduling_policy,
        kv_cache_gib=args.kv_cache_gib,
        hang_timeout_s=args.engine_hang_timeout_s,
        log_stats=not args.disable_log_stats,
        vllm_metrics=args.metrics_port is not None,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        is_default_model=is_default_model,
    )
    return ServeConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        shutdown_grace_s=args.shutdown_grace_s,
        max_message_bytes=args.max_message_bytes,
        max_held_requests=args.max_held_requests,
        max_held_bytes=args.max_held_bytes,
        transfer_timeout_s=args.transfer_timeout_s,
        update_lease_s=args.update_lease_s,
        control_address=args.control_address,
        metrics_port=args.metrics_port,
        exit_with_parent=args.exit_with_parent,
        num_frontends=args.frontends,
        max_frontend_restarts=args.max_frontend_restarts,
        security=security_config(args, dict(os.environ) if environ is None else environ),
    )


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
