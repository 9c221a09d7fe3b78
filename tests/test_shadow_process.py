"""A shadow's processing on plain modules with vLLM's own linear method, no engine, as
`ShadowUpdate._process` does it: vLLM's processing (`vllm_compat.process_after_loading`)
unless the served kernel computes with the weight it is called with (vLLM's F.linear
fallback; on a CPU without native bf16 vLLM fails to pack every layer first, about 1 ms
each). Whichever kernel this CPU gives a dtype, the shadow computes with its new weight and
the served layer still with its old one; a packed kernel is always processed anew."""

from __future__ import annotations

import copy

import pytest
import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

from rlserve.worker.vllm_compat import kernel_holds_no_weights, process_after_loading

OUT, IN = 48, 40


class Layer(LinearBase):
    """The attributes of a vLLM linear layer that its CPU processing and kernel use (vLLM's
    own constructor needs a tensor-parallel group)."""

    def __init__(self, weight: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = weight.shape
        self.quant_method = CountingMethod()


class CountingMethod(UnquantizedLinearMethod):
    def __init__(self) -> None:
        super().__init__()
        self.processed = 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.processed += 1
        super().process_weights_after_loading(layer)


def weights(seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def served_and_shadow(dtype: torch.dtype) -> tuple[Layer, Layer, torch.Tensor, torch.Tensor]:
    old, new = weights(0, dtype), weights(1, dtype)
    served = Layer(old.clone())
    served.quant_method.process_weights_after_loading(served)
    shadow = copy.copy(served)  # as the update builds one: shared attributes, tables of its own
    shadow._parameters = {"weight": torch.nn.Parameter(new.clone(), requires_grad=False)}
    return served, shadow, old, new


def process(shadow: Layer, served: Layer) -> None:
    """As `ShadowUpdate._process` (through `ServedWeights.needs_processing`)."""
    if not kernel_holds_no_weights(served):
        process_after_loading(shadow)


def computed(layer: Layer, dtype: torch.dtype) -> torch.Tensor:
    """W as the layer computes it: the identity through its kernel (exact in any dtype)."""
    with torch.no_grad():
        return layer.cpu_linear(torch.eye(IN, dtype=dtype), layer.weight, None).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_processed_shadow_computes_with_its_new_weight_and_the_served_layer_with_its_old(dtype):
    served, shadow, old, new = served_and_shadow(dtype)
    # vLLM keeps the parameter of a layer it cannot pack, and drops that of one it packs.
    assert kernel_holds_no_weights(served) == (served.weight.numel() > 0)
    process(shadow, served)
    assert torch.equal(computed(shadow, dtype), new)
    assert torch.equal(computed(served, dtype), old)


def test_a_kernel_that_computes_with_its_argument_is_not_processed_again():
    """The layer as vLLM leaves one it cannot pack (its parameter kept, `F.linear` as its
    kernel), built so on any CPU: vLLM packs bf16 where the CPU has AVX-512 BF16 or AMX."""
    old, new = weights(0, torch.bfloat16), weights(1, torch.bfloat16)
    served = Layer(old)
    served.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)
    shadow = copy.copy(served)
    shadow._parameters = {"weight": torch.nn.Parameter(new.clone(), requires_grad=False)}
    kernel = served.cpu_linear
    before = served.quant_method.processed
    process(shadow, served)
    assert served.quant_method.processed == before
    assert shadow.cpu_linear is kernel
    assert torch.equal(computed(shadow, torch.bfloat16), new)


def test_a_packed_kernel_is_processed_anew():
    """One that computes with a copy of its own, whatever it is called with."""
    served, shadow, old, new = served_and_shadow(torch.float32)
    packed = old.clone()
    served.cpu_linear = shadow.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, packed, b)
    before = served.quant_method.processed
    process(shadow, served)
    assert served.quant_method.processed == before + 1
    assert torch.equal(computed(shadow, torch.float32), new)
