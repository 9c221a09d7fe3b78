"""Faults sent into an engine's workers (vLLM's `collective_rpc` with a pickled callable,
into any engine of the `Engines` cache, which accepts them): edges a well-behaved engine never
reaches by itself. The test modules register this module to be pickled by value."""

from __future__ import annotations


def fail_next_load(worker) -> None:
    """The next update's loading fails after 3 tensors (as an out-of-memory would), once. It
    runs on the update's shadow of the model: patched on the class, which the shadow shares."""
    cls = type(worker.model_runner.get_model())
    load = cls.load_weights

    def failing(self, weights):
        cls.load_weights = load
        for i, item in enumerate(weights):
            if i == 3:
                raise RuntimeError("simulated failure after 3 tensors")
            load(self, iter([item]))

    cls.load_weights = failing


def fail_next_prepare(worker) -> None:
    """The next update's second call into the model's loader fails, once: the first loads the
    chunk, the second completes the layers it sent in part (at PrepareWeightUpdate)."""
    cls = type(worker.model_runner.get_model())
    load = cls.load_weights
    calls = []

    def failing(self, weights):
        calls.append(1)
        if len(calls) == 2:
            cls.load_weights = load
            raise RuntimeError("simulated failure while preparing")
        return load(self, weights)

    cls.load_weights = failing


def slow_next_digest(worker) -> None:
    """The next read-back of the served weights takes 3 s longer, once (as a large model's
    does on a slow CPU: a minute for SmolLM2 in bf16 without native bf16)."""
    import time

    from rlserve.worker.served import ServedWeights

    advance = ServedWeights.advance

    def slow(self, budget_s):
        ServedWeights.advance = advance
        time.sleep(3.0)
        return advance(self, budget_s)

    ServedWeights.advance = slow
