"""`rlserve serve`'s flags become the configuration they promise (no engine started)."""

from __future__ import annotations

from rlserve.cli import build_parser, serve_config


def config(*flags: str):
    return serve_config(build_parser().parse_args(["serve", "--model", "/models/m", *flags]), environ={})


def test_observability_flags():
    plain = config()
    assert plain.metrics_port is None and plain.engine.log_stats and not plain.engine.vllm_metrics
    scraped = config("--metrics-port", "9400")
    assert scraped.metrics_port == 9400 and scraped.engine.vllm_metrics, "vLLM's metrics are recorded when scraped"
    assert not config("--disable-log-stats").engine.log_stats


def test_lora_flags():
    off = config()
    assert not off.engine.enable_lora
    on = config("--enable-lora", "--max-loras", "3", "--max-lora-rank", "32")
    assert on.engine.enable_lora and on.engine.max_loras == 3 and on.engine.max_lora_rank == 32
