"""A trainer whose model lives on a CUDA device: what its sync sends (the tensors in the served
dtype, the chunks, every digest, a patch from masks on the device) is byte for byte what the
same model on the CPU sends, so the server serves what a CPU trainer would have sent. Runs
where torch sees a GPU (the device check: `pytest --noconftest tests/test_cuda_trainer.py`,
no engine needed); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from rlserve.sdk.plan import TensorStream, masked_indices, plan, plan_patch, plan_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tensors = {
        "embed.weight": torch.randn(1000, 64, generator=g),
        "layers.0.weight": torch.randn(64, 64, generator=g),
        "layers.0.bias": torch.randn(64, generator=g),
        "norm.weight": torch.ones(64),
    }
    tensors["layers.0.bias"][:3] = -0.0  # digests count -0.0 as +0.0 on every device
    return tensors


def on(device: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(device) for n, t in tensors.items()}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_a_cuda_models_payload_equals_the_cpu_models(dtype):
    cpu, cuda = model(), on("cuda", model())
    sent_cpu, chunks_cpu = plan_sync(cpu, dtype, chunk_bytes=64 << 10, bucket_bytes=16 << 10)
    sent_cuda, chunks_cuda = plan_sync(cuda, dtype, chunk_bytes=64 << 10, bucket_bytes=16 << 10)
    assert chunks_cuda == chunks_cpu and len(chunks_cpu) > 1
    for name, tensor in sent_cuda.items():
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        assert tensor.dtype == sent_cpu[name].dtype
        assert torch.equal(tensor.view(-1).view(torch.uint8), sent_cpu[name].view(-1).view(torch.uint8)), name


def test_a_streamed_cuda_payload_equals_the_cpu_one():
    def stream(tensors: dict[str, torch.Tensor]) -> TensorStream:
        metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
        return TensorStream(metadata, iter(tensors.items()))

    sizes = {"chunk_bytes": 64 << 10, "bucket_bytes": 16 << 10}
    cpu = list(plan(stream(model()), torch.bfloat16, **sizes).chunks())
    cuda = list(plan(stream(on("cuda", model())), torch.bfloat16, **sizes).chunks())
    assert [chunk for chunk, _ in cuda] == [chunk for chunk, _ in cpu]
    assert all(meta.checksum for chunk, _ in cuda for meta in chunk.tensors)
    for (_, sent_cuda), (_, sent_cpu) in zip(cuda, cpu):
        assert all(torch.equal(sent_cuda[n], sent_cpu[n]) and sent_cuda[n].device.type == "cpu" for n in sent_cpu)


def test_masks_on_the_device_make_the_cpu_patch():
    """A trainer's masks of what changed live where its model does (it was a device mismatch
    inside the patch encoder)."""
    old = model()
    new = {n: t.clone() for n, t in old.items()}
    new["embed.weight"][3, :5] += 1
    masks = {"embed.weight": new["embed.weight"] != old["embed.weight"]}
    dense, _ = plan_sync(new)
    on_cpu = plan_patch(dense, masked_indices(masks, dense), "v1")
    on_cuda = plan_patch(dense, masked_indices(on("cuda", masks), dense), "v1")
    assert on_cuda[1] == on_cpu[1] and on_cuda[1][0].tensors[0].num_changed == 5
    assert all(torch.equal(on_cuda[0][n], on_cpu[0][n]) for n in on_cpu[0])
    assert all(t.device.type == "cpu" for t in masked_indices(on("cuda", masks), dense).values())
