"""Every reach of rlserve's code inside vLLM's processes (engine core, workers) past vLLM's
public plugin and worker-extension API, named in one place, for the pinned vLLM minor:
importing this module on another minor fails loudly, naming what to re-check (the server's
side has its own, `rlserve.engine.vllm_compat`).

vLLM's reaches are functions here. Two torch reaches stay inside the algorithms that need
them and are named in REACHES only: the shadow tree's edits of `torch.nn.Module`'s
`_parameters` / `_buffers` / `_modules` tables (`worker/shadow.py`), and gloo's
`ProcessGroupGloo._Options` for a group bound to one address (`wire/gloo_group.py`, which
every side shares and which must not import vLLM)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import vllm

from rlserve.config import check_vllm_version

REACHES = (
    "GPUModelRunner.sample_tokens replaced, input_batch.generators / discard_request_mask read "
    "(CPU seeded sampling, install_cpu_seeded_sampling)",
    "the Worker's vllm_config, model_runner (get_model, reset_lora_state) and weight_transfer_engine "
    "attributes, and state parked on the Worker by attribute (the worker extension)",
    "model_loader.reload.layerwise.get_layerwise_info, reload.sanitize.restore_layer_refs, "
    "weight_utils.default_weight_loader, the _already_called_process_weights_after_loading flag (shadows)",
    "torch.nn.Module's _parameters / _buffers / _modules / _non_persistent_buffers_set (shadows)",
    "torch.distributed.ProcessGroupGloo._Options (wire/gloo_group)",
)
MARK = "_rlserve_cpu_seeded_sampling"
PARKED_PREFIX = "_rlserve_"


def check_version(version: str) -> None:
    """Raises RuntimeError unless `version` (vllm.__version__) is of the pinned minor."""
    check_vllm_version(version, REACHES, other_side="rlserve.engine.vllm_compat")


check_version(vllm.__version__)


# The model runner (worker/vllm_patches) -------------------------------------------------------


def install_cpu_seeded_sampling() -> None:
    """Wrap `GPUModelRunner.sample_tokens` (the CPU runner's too) so that, for one step, the
    generators of seeded requests whose sampled token the step throws away are set aside
    (see `rlserve.worker.vllm_patches` for the defect). Idempotent."""
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
    generators = runner.input_batch.generators
    discard = runner.discard_request_mask.np
    aside = {i: g for i, g in generators.items() if i < len(discard) and discard[i] and g.device.type == "cpu"}
    for i in aside:
        del generators[i]
    try:
        yield
    finally:
        generators.update(aside)


# The Worker the extension is mixed into (worker/extension) -------------------------------------


def worker_vllm_config(worker: Any) -> Any:
    return worker.vllm_config


def worker_model(worker: Any) -> Any:
    return worker.model_runner.get_model()


def reset_lora_state(worker: Any) -> None:
    """As vLLM's own weight-transfer finish does: weights loaded past the model runner's
    reload leave its LoRA state stale."""
    reset = getattr(worker.model_runner, "reset_lora_state", None)
    if reset is not None:
        reset()


def worker_transfer_engine(worker: Any) -> Any | None:
    """The weight-transfer engine vLLM built for the worker from its backend name."""
    return getattr(worker, "weight_transfer_engine", None)


def parked(worker: Any, name: str) -> Any | None:
    """State rlserve keeps on the worker between calls (vLLM offers no place for it)."""
    return getattr(worker, PARKED_PREFIX + name, None)


def park(worker: Any, name: str, value: Any) -> None:
    setattr(worker, PARKED_PREFIX + name, value)


# The model loader's layer-wise reload (worker/shadow) --------------------------------------------


def layerwise_info(module: Any) -> Any:
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(module)


def default_weight_loader() -> Any:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader

    return loader


def restore_layer_refs(tensor: Any, layer: Any) -> Any:
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs as restore

    return restore(tensor, layer)


def forget_weights_processed(layer: Any) -> None:
    """vLLM processes a layer's weights after loading once; a shadow's must be processed again."""
    layer.__dict__.pop("_already_called_process_weights_after_loading", None)
