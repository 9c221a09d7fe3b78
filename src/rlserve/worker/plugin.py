"""vLLM general plugin (entry point `vllm.general_plugins`): registers rlserve's backends,
`rlserve_gloo` and `rlserve_shm`, in every vLLM process. Lazy: nothing heavy is imported here."""

from __future__ import annotations

import contextlib

from rlserve.wire.protocol import BACKEND_NAME, SHM_BACKEND_NAME

ENGINES = {BACKEND_NAME: "GlooWeightTransferEngine", SHM_BACKEND_NAME: "ShmWeightTransferEngine"}


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in ENGINES.items():
        # vLLM calls general plugins more than once per process; a second registration raises
        # ValueError ("already registered"), which is the state we want.
        with contextlib.suppress(ValueError):
            WeightTransferEngineFactory.register_engine(name, "rlserve.worker.engines", cls)
