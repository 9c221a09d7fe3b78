"""vLLM's metrics (`vllm:*`) counted over every frontend process of a server: prometheus_client's
multiprocess mode, as `vllm serve --api-server-count N` uses it. Each process writes its
values into files in one directory and frontend 0's `/metrics` reads them all: counters and
histograms add up over the processes (a dead one's stay counted), and vLLM's scheduler gauges
are the most recent any process set (the engine sends each step's figures to one of them).

prometheus_client picks the mode when it is first imported, from an environment variable, so
`rlserve serve` calls `use_multiprocess_metrics` before anything imports it; the processes it
starts inherit the variable. Nothing here imports prometheus_client.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

logger = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"


def use_multiprocess_metrics() -> tempfile.TemporaryDirectory | None:
    """Turn the mode on for this process and those it starts, in a fresh directory the caller
    removes at the end (None: a directory was given in the environment, and is used)."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client is imported already: multiprocess metrics must be chosen before")
    if ENV in os.environ:
        logger.warning("vLLM metrics go to %s=%s; empty it between runs", ENV, os.environ[ENV])
        return None
    directory = tempfile.TemporaryDirectory(prefix="rlserve-metrics-")
    os.environ[ENV] = directory.name
    return directory


def multiprocess_directory() -> str | None:
    """Where every process writes its metrics, when the mode is on."""
    return os.environ.get(ENV)
