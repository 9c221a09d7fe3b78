"""vLLM's weight-transfer calls, with deadlines, and their failures mapped to domain errors.

The configured backend (vLLM's nccl/ipc/... or rlserve's `rlserve_gloo`) runs inside the
workers; this module only drives it through `collective_rpc` and reads back what it reports.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.async_llm import AsyncLLM

from rlserve.errors import InvalidRequest, TransferTimeout
from rlserve.transfer.protocol import CHECKSUM_MISMATCH, INVALID_UPDATE, TRANSFER_TIMEOUT

# Room for the worker's own deadline to fire first and report what went wrong.
DEADLINE_MARGIN_S = 10.0


class EngineWeightTransfer:
    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm

    async def init(self, init_info: dict[str, Any], timeout_s: float) -> None:
        await self._call("init_weight_transfer_engine", timeout_s, init_info=init_info)

    async def start(self, is_draft: bool, timeout_s: float) -> None:
        await self._call("start_draft_weight_update" if is_draft else "start_weight_update", timeout_s)

    async def update(self, update_info: dict[str, Any], timeout_s: float) -> None:
        await self._call("update_weights", timeout_s, update_info=update_info)

    async def finish(self, timeout_s: float) -> None:
        await self._call("finish_weight_update", timeout_s)

    async def abort(self, timeout_s: float) -> None:
        await self._call("rlserve_abort_weight_update", timeout_s)

    async def checksums(self, timeout_s: float) -> list[dict[str, Any]]:
        """Per worker: {"per_tensor": {name: digest}, "overall": digest}."""
        return await self._call("rlserve_weight_checksums", timeout_s)

    async def _call(self, method: str, timeout_s: float, **kwargs: Any) -> Any:
        try:
            return await self._llm.collective_rpc(method, timeout=timeout_s + DEADLINE_MARGIN_S, kwargs=kwargs)
        except TimeoutError as e:
            raise TransferTimeout(f"{method} did not finish within {timeout_s:.0f} s") from e
        except Exception as e:  # noqa: BLE001 - worker errors arrive as text; classify them
            raise _classify(method, e) from e


def _classify(method: str, error: Exception) -> Exception:
    text = str(error)
    for marker, make in (
        (INVALID_UPDATE, lambda m: InvalidRequest("update_info_json", m)),
        (CHECKSUM_MISMATCH, lambda m: InvalidRequest("update_info_json", m)),
        (TRANSFER_TIMEOUT, TransferTimeout),
    ):
        if marker in text:
            detail = text[text.index(marker) + len(marker) :].lstrip(": ").splitlines()[0]
            # vLLM wraps the worker's message: "Worker failed with error '<msg>', please ..."
            return make(detail.split("', please check")[0])
    return RuntimeError(f"{method} failed: {text}")
