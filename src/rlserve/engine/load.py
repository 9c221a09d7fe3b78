"""How busy each data-parallel engine is, from the scheduler stats vLLM already sends with its
outputs (no extra round trip to the engine core): a stat logger that keeps the latest figures
per engine for `Lifecycle/GetLoad`. With several frontend processes the engine sends each
step's figures to one of them (the first with outputs that step), so every one keeps a board,
the others pass theirs on to frontend 0 (`forward`), and frontend 0 keeps the newest."""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from rlserve.types import EngineLoad


class LoadBoard:
    """The latest scheduler figures of every engine; written by vLLM's output handler."""

    def __init__(self, forward: Callable[[EngineLoad], None] | None = None) -> None:
        self._latest: dict[int, EngineLoad] = {}
        self._forward = forward

    def logger(self, vllm_config: VllmConfig, engine_index: int) -> StatLoggerBase:
        """A per-engine stat logger factory for `AsyncLLM(stat_loggers=[board.logger])`."""
        self._latest[engine_index] = EngineLoad(engine_index, 0, 0, 0.0, 0.0)
        return _Recorder(self, engine_index)

    def record(self, engine_index: int, stats: SchedulerStats) -> None:
        load = EngineLoad(
            engine_index,
            stats.num_running_reqs,
            stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
            stats.kv_cache_usage,
            time.time(),
        )
        self.merge(load)
        if self._forward is not None:
            self._forward(load)

    def merge(self, load: EngineLoad) -> None:
        """Figures another frontend process received: kept if newer than what is here."""
        current = self._latest.get(load.data_parallel_rank)
        if current is None or load.unix_time_s >= current.unix_time_s:
            self._latest[load.data_parallel_rank] = load

    def engines(self) -> tuple[EngineLoad, ...]:
        return tuple(self._latest[i] for i in sorted(self._latest))


class _Recorder(StatLoggerBase):
    def __init__(self, board: LoadBoard, engine_index: int) -> None:
        self._board = board
        self._engine_index = engine_index

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: object = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self._board.record(engine_idx, scheduler_stats)

    def log_engine_initialized(self) -> None:
        pass


class NoPrometheus(PrometheusStatLogger):
    """Stands in for vLLM's Prometheus logger when nothing scrapes its metrics (no
    --metrics-port): vLLM adds that logger unless one is given, and it observes histograms for
    every token. Records nothing."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        pass

    def record(self, *args: object, **kwargs: object) -> None:
        pass

    def record_sleep_state(self, *args: object, **kwargs: object) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass
