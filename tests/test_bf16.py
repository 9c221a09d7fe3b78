"""A bfloat16 server (SmolLM2's dtype, and the demo's), against an engine of that dtype: what
the suite's float32 engines do not reach. On a CPU without native bf16 vLLM cannot pack a
bf16 linear layer and computes with its parameter (`F.linear`); with AVX-512 BF16 or AMX it
packs, as in float32. Either way a staged sync serves what was sent, digests read back
included, and every layer's kernel computes with the weights the digests describe."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

import cloudpickle
import pytest_asyncio
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.config import ServeConfig
from rlserve.sdk.client import Client
from rlserve.sdk.weight_sync import WeightSync
from rlserve.wire.protocol import tensor_checksum

from helpers import checkpoint, greedy, perturbed, serving

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FIELDS = {"dtype": "bfloat16", "weight_transfer_backend": "rlserve_shm"}


@pytest_asyncio.fixture(scope="module")
async def s(engines, engine_config):
    engine = await engines.get(**FIELDS)
    async with serving(engine, ServeConfig(engine=replace(engine_config, **FIELDS), transfer_timeout_s=20.0)) as stubs:
        yield stubs


def bf16(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in weights.items()}


def staged_sync(target: str, weights: dict[str, torch.Tensor], version: str):
    with Client(target) as client:
        sync = WeightSync(client, timeout_s=20.0)
        try:
            return sync.sync(weights, version, staged=True)  # verified: the served digests
        finally:
            sync.close()


def _kernels_compute_with_their_parameters(worker) -> list[tuple[str, bool]]:
    """Per linear layer (and lm_head) that kept its parameter (an unpacked kernel): whether
    the identity through its kernel gives that parameter back."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    out = []
    for name, module in worker.model_runner.get_model().named_modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)) or not hasattr(module, "cpu_linear"):
            continue
        weight = module.weight
        if weight.dim() != 2 or weight.numel() == 0:
            continue  # packed: its parameter was dropped, the digest reads it through the kernel
        with torch.no_grad():
            computed = module.cpu_linear(torch.eye(weight.shape[1], dtype=weight.dtype), weight, None).t()
        out.append((name, bool(torch.equal(computed, weight))))
    return out


def _record_processing(worker) -> None:
    """From now on, note each layer vLLM's processing runs on, and whether its kernel computes
    with the weight it is called with (it had nothing to pack)."""
    from rlserve.worker import vllm_compat

    original = vllm_compat.__dict__.get("_unrecorded", vllm_compat.process_after_loading)
    seen: list[tuple[str, bool]] = []

    def recording(layer):
        seen.append((type(layer).__name__, vllm_compat.kernel_holds_no_weights(layer)))
        original(layer)

    vllm_compat._unrecorded, vllm_compat._processed = original, seen
    vllm_compat.process_after_loading = recording


def _processing_recorded(worker) -> list[tuple[str, bool]]:
    from rlserve.worker import vllm_compat

    vllm_compat.process_after_loading = vllm_compat.__dict__.pop("_unrecorded")
    return vllm_compat.__dict__.pop("_processed")


async def test_a_staged_sync_serves_what_was_sent_with_kernels_that_compute_it(s, engines, tiny_model_dir):
    """Back on the checkpoint after two syncs, the server generates what vLLM's own load of
    it generated (no other module uses this engine)."""
    engine = await engines.get(**FIELDS)
    weights = bf16(perturbed(tiny_model_dir, seed=61))
    loaded_by_vllm = await greedy(s.inference)
    stats = await asyncio.to_thread(staged_sync, s.target, weights, "bf16-1")
    assert stats.staged
    served = await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())
    assert dict(served.per_tensor) == {n: tensor_checksum(t) for n, t in weights.items()}
    assert not served.inconsistent_tensors
    (layers,) = await engine.llm.collective_rpc(_kernels_compute_with_their_parameters)
    assert layers and all(ok for _, ok in layers), [name for name, ok in layers if not ok]
    # A second sync back to the checkpoint: the first one's kernels were not kept by mistake.
    await asyncio.to_thread(staged_sync, s.target, bf16(checkpoint(tiny_model_dir)), "bf16-2")
    (layers,) = await engine.llm.collective_rpc(_kernels_compute_with_their_parameters)
    assert all(ok for _, ok in layers)
    assert await greedy(s.inference) == loaded_by_vllm


async def test_a_layer_with_nothing_to_pack_is_not_processed_again(s, engines, tiny_model_dir):
    """vLLM would try to pack it first and fail (on a CPU without native bf16, 1 ms for each
    linear layer): its served kernel is kept. Where bf16 packs, nothing is skipped."""
    engine = await engines.get(**FIELDS)
    await engine.llm.collective_rpc(_record_processing)
    try:
        await asyncio.to_thread(staged_sync, s.target, bf16(perturbed(tiny_model_dir, seed=62)), "bf16-0")
    finally:
        (processed,) = await engine.llm.collective_rpc(_processing_recorded)
    assert processed  # the norms and the embedding at least
    assert [kind for kind, nothing_to_pack in processed if nothing_to_pack] == []
