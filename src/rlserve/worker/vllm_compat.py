"""Every reach of rlserve's code inside vLLM's processes (engine core, workers) into vLLM's or
torch's internals, named in one place, for the pinned vLLM minor: importing this module on
another minor fails loudly, naming what to re-check (the server's side has its own,
`rlserve.engine.vllm_compat`). The gloo group's torch privates stay in `rlserve.wire.gloo_group`,
which the trainer shares and which must not import vLLM or worker code; REACHES names them.

Each function says why rlserve needs the reach and what breaks if vLLM or torch moves it. The
rest of `worker/` uses vLLM's plugin interfaces (INTERFACES) and these. vLLM's own modules are
imported inside the functions: the server's process loads this module (through the worker
extension) and needs neither the model runner nor the layers."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import vllm

from rlserve.config import check_vllm_version
from rlserve.wire.gloo_group import TORCH_PRIVATES
from rlserve.wire.protocol import ErrorCode, WorkerError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

REACHES = (
    "GPUModelRunner.sample_tokens replaced, input_batch.generators / discard_request_mask read "
    "(CPU seeded sampling, install_cpu_seeded_sampling)",
    "vllm.v1.worker.worker_base loaded, the platform's is_cpu (where the seeded-sampling mend goes)",
    "the Worker's vllm_config, model_runner (get_model, reset_lora_state) and weight_transfer_engine "
    "attributes, and state parked on the Worker by attribute (the worker extension)",
    "vllm.config.set_current_vllm_config around processing loaded weights (the worker extension)",
    "the layers: LinearBase, ParallelLMHead, VocabParallelEmbedding.org_vocab_size, the Unquantized*Method "
    "quant methods, cpu_linear, output_sizes, *_per_partition sizes, packed_modules_mapping, LoRA's "
    "base_layer (served-weight digests)",
    "model.load_weights, model_loader.reload.layerwise.get_layerwise_info, reload.sanitize.restore_layer_refs, "
    "weight_utils.default_weight_loader, a parameter's weight_loader, QuantizeMethodBase."
    "process_weights_after_loading and its _already_called_process_weights_after_loading flag (shadows)",
    "torch.nn.Module's _parameters / _buffers / _modules / _non_persistent_buffers_set (shadows)",
    *TORCH_PRIVATES,
)
# vLLM's extension points rlserve implements: public, but shaped by the pin too.
INTERFACES = (
    "the vllm.general_plugins entry points (worker/plugin.py, worker/vllm_patches.py, worker/lifetime.py)",
    "WeightTransferEngine and WeightTransferEngineFactory.register_engine (worker/engines.py, worker/plugin.py)",
    "worker_extension_cls, mixed into the Worker class (worker/extension.py)",
)
MARK = "_rlserve_cpu_seeded_sampling"
PARKED_PREFIX = "_rlserve_"


def check_version(version: str) -> None:
    """Raises RuntimeError unless `version` (vllm.__version__) is of the pinned minor."""
    check_vllm_version(version, (*REACHES, *INTERFACES), other_side="rlserve.engine.vllm_compat")


check_version(vllm.__version__)


# The model runner (worker/vllm_patches) -------------------------------------------------------


def is_worker_process() -> bool:
    """A worker loads the general plugins from `vllm.v1.worker.worker_base`, no other vLLM
    process does. If vLLM moves that module, the seeded-sampling mend is never installed and a
    split seeded prefill kills a CPU engine again (tests/test_hardening_generate.py)."""
    return "vllm.v1.worker.worker_base" in sys.modules


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def install_cpu_seeded_sampling() -> None:
    """Wrap `GPUModelRunner.sample_tokens` (the CPU runner's too) so that, for one step, the
    generators of seeded requests whose sampled token the step throws away are set aside
    (see `rlserve.worker.vllm_patches` for the defect). vLLM has no hook around a step's
    sampling. Renamed, this raises AttributeError as the worker starts; if the rewind moves
    out of `sample_tokens`, the wrapper no longer covers it. Idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.sample_tokens, MARK, False):
        return
    original = GPUModelRunner.sample_tokens

    @functools.wraps(original)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _discarded_generators_set_aside(self):
            return original(self, *args, **kwargs)

    setattr(sample_tokens, MARK, True)
    setattr(GPUModelRunner, "sample_tokens", sample_tokens)  # noqa: B010  a reach, named in REACHES


@contextlib.contextmanager
def _discarded_generators_set_aside(runner: Any) -> Iterator[None]:
    # The runner's own table (by batch index): edits change what this step uses.
    generators: dict[int, torch.Generator] = runner.input_batch.generators
    discard: np.ndarray = runner.discard_request_mask.np
    aside = {i: g for i, g in generators.items() if i < len(discard) and discard[i] and g.device.type == "cpu"}
    for i in aside:
        del generators[i]
    try:
        yield
    finally:
        generators.update(aside)


# The Worker the extension is mixed into (worker/extension) -------------------------------------


class VllmWorker(Protocol):
    """What rlserve reads of vLLM's worker (`vllm.v1.worker.gpu_worker.Worker`, which the CPU
    worker extends). The extension has no constructor of its own: vLLM adds it to the Worker
    class's bases, so `self` in its methods is the worker."""

    vllm_config: VllmConfig
    model_runner: Any


def worker_vllm_config(worker: VllmWorker) -> VllmConfig:
    return worker.vllm_config


def worker_model(worker: VllmWorker) -> torch.nn.Module:
    """The model the worker serves (what the digests read and the shadows are built beside)."""
    model: torch.nn.Module = worker.model_runner.get_model()
    return model


def reset_lora_state(worker: VllmWorker) -> None:
    """As vLLM's own weight-transfer finish does: weights loaded past the model runner's
    reload leave its LoRA state stale. Runners without LoRA support have no such method."""
    reset = getattr(worker.model_runner, "reset_lora_state", None)
    if reset is not None:
        reset()


def worker_transfer_engine(worker: VllmWorker) -> object | None:
    """The weight-transfer engine vLLM built for the worker from its backend name. Renamed by
    vLLM, every rlserve backend call answers WRONG_STATE ("not one of rlserve's")."""
    return getattr(worker, "weight_transfer_engine", None)


def parked(worker: VllmWorker, name: str) -> object | None:
    """State rlserve keeps on the worker between `collective_rpc` calls: vLLM offers no place
    for it, and the worker object lives exactly as long as the state should. The prefix keeps
    clear of vLLM's names; a Worker with `__slots__` would refuse it."""
    return getattr(worker, PARKED_PREFIX + name, None)


def park(worker: VllmWorker, name: str, value: object) -> None:
    setattr(worker, PARKED_PREFIX + name, value)


@contextlib.contextmanager
def current_config(worker: VllmWorker) -> Iterator[None]:
    """vLLM's layers read the current vLLM config while processing loaded weights (on CPU:
    which GEMM kernel to pack); vLLM sets it only around its own loading."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        yield


# The served model's layers (worker/served) -----------------------------------------------------


def is_wrapped_for_lora(model: torch.nn.Module) -> bool:
    """vLLM wraps each layer of a model served with --enable-lora (the layer becomes the
    wrapper's `base_layer`): the served weights are not where the digests look."""
    return any(name.endswith(".base_layer") for name, _ in model.named_modules())


def fused_members(model: torch.nn.Module) -> dict[str, list[str]]:
    """The model class's fused layers and the checkpoint tensors each one fuses, in the order
    of their rows (qkv_proj: q_proj, k_proj, v_proj). Gone, fused tensors are not found."""
    return dict(getattr(type(model), "packed_modules_mapping", None) or {})


def fused_output_sizes(module: torch.nn.Module) -> list[int]:
    """The rows of each member of a fused layer; empty when vLLM does not record them."""
    return list(getattr(module, "output_sizes", None) or ())


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether the layer computes with a quantized weight (not a checkpoint tensor's value).
    A new unquantized method in vLLM reads as quantized: refused, never described wrongly."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    method = getattr(module, "quant_method", None)
    return method is not None and not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))


def served_vocabulary_rows(module: torch.nn.Module) -> slice | None:
    """The rows of an embedding (or lm_head) that are the checkpoint's; the rest is vLLM's
    padding of the vocabulary. None for any other layer."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return slice(0, module.org_vocab_size) if isinstance(module, VocabParallelEmbedding) else None


def has_packed_kernel(module: torch.nn.Module) -> bool:
    """On CPU a linear layer or an lm_head computes with a packed copy of its weight, through
    `cpu_linear`: a digest of its parameter would not describe what it computes."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return hasattr(module, "cpu_linear") and isinstance(module, (LinearBase, ParallelLMHead))


def kernel_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight a packed layer's kernel is called with (its dtype is the layer's)."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise WorkerError(ErrorCode.UNSUPPORTED, f"{type(module).__name__} has no weight tensor")
    return weight


def kernel_shape(module: torch.nn.Module) -> tuple[int, int]:
    """(out, in) of this worker's part of a linear layer or an lm_head."""
    return (
        _size(module, "output_size_per_partition", "num_embeddings_per_partition"),
        _size(module, "input_size_per_partition", "embedding_dim"),
    )


def kernel_computes_with_its_argument(module: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Whether the layer's kernel computes x W^T from the weight it is called with rather than
    from a packed copy of its own. vLLM falls back to `F.linear` where it cannot pack (bf16 on
    a CPU without AVX-512 BF16 or AMX), and its forward passes the layer's `weight`: that
    parameter is then exactly what is served. A unit row through the kernel, once with a
    one-row weight of zeros and once of ones, tells which: a kernel that computes with it
    answers 0 then 1; a packed kernel gives its own first column both times, which cannot be
    all 0 and all 1 at once. One row, not the layer's: a product of the layer's size costs
    0.9 s for SmolLM2's lm_head in bf16 on a CPU without native bf16. A kernel that refuses
    the probe's weights is read the way that suits every kernel (through the identity)."""
    in_features = weight.shape[1]
    unit = torch.zeros(1, in_features, dtype=weight.dtype)
    unit[0, 0] = 1
    try:
        with torch.no_grad():
            zeros = run_packed_kernel(module, unit, torch.zeros(1, 1, dtype=weight.dtype).expand(1, in_features))
            ones = run_packed_kernel(module, unit, torch.ones(1, 1, dtype=weight.dtype).expand(1, in_features))
    except RuntimeError:
        return False
    return bool((zeros == 0).all() and (ones == 1).all())


def kernel_holds_no_weights(module: torch.nn.Module) -> bool:
    """Whether a CPU layer (linear, embedding or lm_head) has a kernel that computes with
    the weight it is called with (vLLM's `F.linear`, where it cannot pack: bf16 on a CPU
    without AVX-512 BF16 or AMX), its own weight (unpacked) in its place."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if not callable(getattr(module, "cpu_linear", None)) or not isinstance(
        module, (LinearBase, VocabParallelEmbedding)
    ):
        return False
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == kernel_shape(module)
        and kernel_computes_with_its_argument(module, weight)
    )


def run_packed_kernel(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as the layer computes it, without bias (read at each call: a commit replaces
    the kernel)."""
    kernel = getattr(module, "cpu_linear", None)
    if not callable(kernel):
        raise WorkerError(ErrorCode.UNSUPPORTED, f"{type(module).__name__} has no packed kernel")
    result: torch.Tensor = kernel(x, weight, None)
    return result


def _size(module: torch.nn.Module, *names: str) -> int:
    """The first of `names` the layer sets (a linear layer and an embedding name theirs apart)."""
    for name in names:
        value = getattr(module, name, None)
        if value:
            return int(value)
    raise WorkerError(ErrorCode.UNSUPPORTED, f"{type(module).__name__} sets none of {list(names)}")


# The model loader (worker/shadow) ---------------------------------------------------------------


def load_checkpoint_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """The model class's own loading of checkpoint tensors, so names, fusion and padding stay
    vLLM's code. Every vLLM model class has `load_weights(iterable of (name, tensor))`."""
    model.load_weights(iter(tensors.items()))  # type: ignore[operator]  # vLLM's models have it, torch's Module not


def recorded_format(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.device]:
    """The parameters and buffers vLLM recorded of `module` when the model loaded (in the
    format checkpoint tensors load into, before processing packed them), and the device to
    create them on. If vLLM stops recording them, shadows are built in the served format and
    loading into them fails."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    info = get_layerwise_info(module)
    params, buffers = info.restore_metadata
    return dict(params), dict(buffers), info.restore_device


def weight_loader_of(tensor: torch.Tensor) -> Callable[..., Any]:
    """How vLLM's `load_weights` loads a checkpoint tensor into this parameter: its
    `weight_loader`, else vLLM's default (a plain copy)."""
    loader = getattr(tensor, "weight_loader", None)
    if callable(loader):
        return loader
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return default_weight_loader


def set_weight_loader(tensor: torch.Tensor, loader: Callable[..., Any]) -> None:
    tensor.weight_loader = loader  # type: ignore[attr-defined]  # vLLM's attribute on its parameters


def restore_layer_refs(tensor: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """Methods of `tensor` that vLLM bound to its placeholder for the layer (once it recorded
    the layer for reloading), bound to `layer`: a weight loader then writes `layer`."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs as restore

    return restore(tensor, layer)


def process_after_loading(layer: torch.nn.Module) -> None:
    """vLLM's processing after a layer's weights are loaded (on CPU: pack the GEMM kernel),
    once more: vLLM's quant methods flag a layer they processed and skip it the next time."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    layer.__dict__.pop("_already_called_process_weights_after_loading", None)
    method = getattr(layer, "quant_method", None)
    if isinstance(method, QuantizeMethodBase):
        method.process_weights_after_loading(layer)


# torch.nn.Module's own tables (worker/shadow) --------------------------------------------------
# A shadow is a shallow copy of a served module with tables of its own; torch has no public way
# to make one (setattr registers, checks, and writes the table the copy shares). If torch
# renames a table, a shadow shares the served one (an update writes the served model mid-sync)
# or the lookups here raise KeyError.

PARAMETERS, BUFFERS, CHILDREN = "_parameters", "_buffers", "_modules"
TENSOR_TABLES = (PARAMETERS, BUFFERS)
MODULE_TABLES = (PARAMETERS, BUFFERS, CHILDREN)


def table(module: torch.nn.Module, name: str) -> dict[str, Any]:
    """One of the module's own tables, itself: edits change the module."""
    entries: dict[str, Any] = module.__dict__[name]
    return entries


def set_table(module: torch.nn.Module, name: str, entries: dict[str, Any]) -> None:
    """Give the module a table of its own (a `copy.copy` of a module shares its original's)."""
    module.__dict__[name] = entries


def copy_buffer_persistence(shadow: torch.nn.Module, module: torch.nn.Module) -> None:
    """Give `shadow` its own copy of which of `module`'s buffers a state dict leaves out."""
    shadow.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
