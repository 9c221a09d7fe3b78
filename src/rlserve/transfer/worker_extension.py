"""Methods rlserve adds to every vLLM worker (vLLM's `worker_extension_cls` mechanism),
called by name through `collective_rpc`: abandon an update and digest the
weights the worker serves."""

from __future__ import annotations

from typing import Any

from rlserve.transfer.protocol import combined_checksum, tensor_checksum


class RlserveWorkerExtension:
    """Mixed into vLLM's Worker class; `self` is the worker."""

    def rlserve_abort_weight_update(self) -> None:
        """Drop the open update session. Only staging backends can promise the served weights
        are untouched; the controller knows which backend it drives."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return
        abort = getattr(engine, "abort", None)
        if abort is not None:
            abort()
        if getattr(self, "_weight_update_active", False):
            # Close the worker's own session bookkeeping the way a finish would, without
            # loading anything (the staging backend's finish is a no-op once aborted).
            self.finish_weight_update()

    def rlserve_weight_checksums(self) -> dict[str, Any]:
        """Per-tensor digests (HF checkpoint names) of the weights this worker serves: the
        checkpoint it loaded, overlaid with every tensor committed by a weight update since."""
        cache = getattr(self, "_rlserve_checkpoint_checksums", None)
        if cache is None:
            cache = _checkpoint_checksums(self.vllm_config.model_config.model)
            self._rlserve_checkpoint_checksums = cache
        engine = getattr(self, "weight_transfer_engine", None)
        committed = getattr(engine, "committed_checksums", {}) if engine is not None else {}
        per_tensor = {**cache, **committed}
        return {"per_tensor": per_tensor, "overall": combined_checksum(per_tensor)}


def _checkpoint_checksums(model_dir: str) -> dict[str, str]:
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, str] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            out[name] = tensor_checksum(tensor)
    return out
