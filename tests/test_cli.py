"""`rlserve serve`'s flags become the configuration they promise, and what cannot work is
refused in one line with status 2 (no engine started)."""

from __future__ import annotations

import subprocess
import sys

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


def test_frontend_restart_flags():
    assert config().max_frontend_restarts == 4
    assert (
        config(
            "--frontends", "2", "--control-address", "127.0.0.1:1", "--max-frontend-restarts", "0"
        ).max_frontend_restarts
        == 0
    )


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlserve", *args], capture_output=True, text=True, timeout=60)


def test_a_model_that_is_no_local_directory_is_one_clear_line(tmp_path):
    """It ended in a Hugging Face repo-id traceback from deep inside vLLM."""
    for model, why in ((tmp_path / "missing", "no such directory"), (tmp_path, "no config.json")):
        done = run_cli("serve", "--model", str(model))
        assert done.returncode == 2, done.stderr[-2000:]
        assert why in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_demo_refuses_an_empty_server():
    """`--server ""` and `--server ,` started a server of the demo's own, silently."""
    for value in ("", ",", "127.0.0.1:1,"):
        done = run_cli("demo", "--server", value)
        assert done.returncode == 2 and "--server needs HOST:PORT" in done.stderr, (value, done.stderr[-2000:])
