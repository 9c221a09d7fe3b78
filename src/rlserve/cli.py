"""`rlserve serve`: parse the command line once into a `ServeConfig` and run the server."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rlserve.config import DTYPES, EngineConfig, ServeConfig, default_cache_dir

# The dataclasses own the defaults; the CLI shows them.
_ENGINE = EngineConfig.__dataclass_fields__
_SERVE = ServeConfig.__dataclass_fields__


def _default(fields: dict, name: str) -> object:
    return fields[name].default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over gRPC (vllm.Inference, vllm.Control)")
    s.add_argument("--model", default="", help="local HF model directory (default: SmolLM2-135M-Instruct)")
    s.add_argument("--served-model-name", default="", help="name clients use (default: the model path)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--dtype", default="auto", choices=DTYPES)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--data-parallel-size", type=int, default=1)
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--weight-transfer-backend", default="", help="rlserve_gloo (CPU or GPU), or vLLM's nccl, ipc, ...")
    s.add_argument("--enable-sleep-mode", action="store_true")
    s.add_argument("--scheduling-policy", default=_default(_ENGINE, "scheduling_policy"), choices=("fcfs", "priority"))
    s.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (CPU default: 1 GiB)")
    s.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="converted models live here")
    s.add_argument("--shutdown-grace-s", type=float, default=_default(_SERVE, "shutdown_grace_s"))
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
    return parser


def serve_config(args: argparse.Namespace) -> ServeConfig:
    model, served_name, dtype = args.model, args.served_model_name, args.dtype
    if not model:
        from rlserve.model_cache import DEFAULT_MODEL_NAME, default_model_dir

        model = str(default_model_dir(args.cache_dir / "models" / DEFAULT_MODEL_NAME))
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
        enable_sleep_mode=args.enable_sleep_mode,
        scheduling_policy=args.scheduling_policy,
        kv_cache_gib=args.kv_cache_gib,
        hang_timeout_s=args.engine_hang_timeout_s,
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
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        config = serve_config(args)
    except ValueError as e:
        print(f"rlserve: {e}", file=sys.stderr)
        return 2
    import uvloop

    from rlserve.server.app import serve

    # uvloop (a vLLM dependency) costs grpc.aio ~20 µs less CPU per streamed message.
    uvloop.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
