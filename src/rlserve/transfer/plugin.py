"""vLLM general plugin (entry point `vllm.general_plugins`): registers the `rlserve_gloo`
weight-transfer backend in every vLLM process. Lazy: nothing heavy is imported here."""

from __future__ import annotations

import contextlib

from rlserve.transfer.protocol import BACKEND_NAME


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # vLLM calls general plugins more than once per process; a second registration raises
    # ValueError ("already registered"), which is the state we want.
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "rlserve.transfer.gloo_engine", "GlooWeightTransferEngine"
        )
