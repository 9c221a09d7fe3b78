"""Reading a linear layer's served weight (`rlserve.worker.served._read_kernel`) on plain torch
modules, no engine: through vLLM's own CPU dispatch in each dtype, whichever kernel this CPU
gets; a kernel that computes with the weight it is called with is read from that weight, not
by pushing the identity through it; a packed kernel is read through the kernel, whatever its
weight parameter says."""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

from rlserve.worker import served
from rlserve.worker.served import _read_kernel

OUT, IN = 48, 40


class Layer(torch.nn.Module):
    """The attributes of a vLLM linear layer that the read uses."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = weight.shape
        self.rows_seen: list[int] = []

    def count(self, x: torch.Tensor) -> None:
        self.rows_seen.append(x.shape[0])


def weights(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_under_vllms_cpu_dispatch_reads_back_its_weight(dtype):
    w = weights(dtype)
    layer = Layer(w.clone())
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert torch.equal(_read_kernel(layer), w)


def test_a_kernel_that_computes_with_its_argument_is_read_from_it_not_run_over_the_identity():
    layer = Layer(weights(torch.bfloat16))

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        layer.count(x)
        return torch.nn.functional.linear(x, weight, bias)

    layer.cpu_linear = linear
    assert torch.equal(_read_kernel(layer), layer.weight)
    assert layer.rows_seen == [1, 1]  # the probe's two unit rows, nothing of the layer's size


def test_the_probe_multiplies_one_row_of_weights_not_the_layers():
    """On a CPU without native bf16 a product of the lm_head's size takes most of a second."""
    layer = Layer(weights(torch.bfloat16))
    shapes: list[tuple[int, ...]] = []

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shapes.append(tuple(weight.shape))
        return torch.nn.functional.linear(x, weight, bias)

    layer.cpu_linear = linear
    assert torch.equal(_read_kernel(layer), layer.weight)
    assert shapes == [(1, IN), (1, IN)]


@pytest.mark.parametrize("first_column", [0.0, 1.0, None])
def test_a_packed_kernel_is_read_through_the_kernel_not_from_its_parameter(first_column):
    """What the kernel computes with differs from the parameter (as after vLLM's own weight
    reset); a first column of all 0 or all 1 cannot pass for an unpacked kernel."""
    packed = weights(torch.float32)
    if first_column is not None:
        packed[:, 0] = first_column
    layer = Layer(torch.zeros(OUT, IN))

    def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        layer.count(x)
        return torch.nn.functional.linear(x, packed, bias)

    layer.cpu_linear = kernel
    assert torch.equal(_read_kernel(layer), packed)
    assert sum(layer.rows_seen) >= IN  # every row of the identity went through it


def test_a_kernel_that_refuses_the_probes_weights_is_read_through_the_identity():
    """One that wants a weight with strides of its own (the probe's are broadcast)."""
    layer = Layer(weights(torch.float32))

    def strict(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not weight.is_contiguous():
            raise RuntimeError("expected a contiguous weight")
        layer.count(x)
        return torch.nn.functional.linear(x, weight, bias)

    layer.cpu_linear = strict
    assert torch.equal(_read_kernel(layer), layer.weight)
    assert sum(layer.rows_seen) >= IN


def test_a_packed_kernel_is_read_in_pieces_of_bounded_work(monkeypatch):
    """Between pieces a digest pass lets the engine step: each piece feeds the kernel about
    PROBE_BLOCK_MACS multiply-adds' worth of identity rows, never under PROBE_MIN_ROWS."""
    monkeypatch.setattr(served, "PROBE_BLOCK_MACS", 8 * IN * OUT)
    monkeypatch.setattr(served, "PROBE_MIN_ROWS", 4)
    packed = weights(torch.float32)
    layer = Layer(torch.zeros(OUT, IN))
    layer.cpu_linear = lambda x, weight, bias: (layer.count(x), torch.nn.functional.linear(x, packed, bias))[1]
    reading = served._read_kernel_in_pieces(layer)
    fed_per_piece = []
    while True:
        seen = len(layer.rows_seen)
        try:
            next(reading)
        except StopIteration as done:
            assert torch.equal(done.value, packed)
            break
        fed_per_piece.append(sum(layer.rows_seen[seen:]))
    assert fed_per_piece == [2 + 8] + [8] * (IN // 8 - 1)  # the first after the probe's two unit rows
    monkeypatch.setattr(served, "PROBE_BLOCK_MACS", 1)
    assert torch.equal(served._read_kernel(layer), packed)
    assert layer.rows_seen[-1] == 4  # a block of PROBE_MIN_ROWS, however small the budget
