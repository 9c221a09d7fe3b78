"""A weight update built beside the served model while it arrives, swapped in at the commit.

Every layer the update touches gets a shadow: a shallow copy of the served module with
tensors of its own, in the format the checkpoint loads into (vLLM records that format for
every layer when the model loads). The model's own `load_weights` fills the shadows bucket by
bucket, run on a shadow of the whole module tree, so checkpoint names, fusion (q/k/v into
qkv_proj) and padding stay vLLM's code. A layer whose checkpoint tensors have all arrived is
processed at once (its quant method's post-load step; on CPU that packs the GEMM kernel;
a served kernel that computes with the weight it is called with is kept as it is)
while later buckets are still on the wire. The commit only swaps: a processed CPU tensor
replaces the served one that only the modules being swapped hold (its own, or an embedding
and its tied head, both given the new one); one held elsewhere too, or on a GPU (a captured
graph keeps its address), is copied into the served storage instead; and
the attributes processing set (the CPU kernel) are moved onto the served module. A tied
head (an lm_head that serves the embedding's weight) is processed from the embedding's new
weight.

Shadows hold one processed copy of the updated layers until the commit or an abort; the
served model is untouched until `commit()`. With `in_place`, each layer is installed as soon
as it is processed instead: one layer of extra memory, but a failure half way leaves the
served weights mixed (the caller reports them inconsistent). Dense layers only, as far as
`ServedWeights` describes them.
"""

from __future__ import annotations

import copy
import inspect
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from types import MethodType
from typing import Any

import torch

from rlserve.wire.protocol import ErrorCode, WorkerError
from rlserve.worker import vllm_compat
from rlserve.worker.served import ServedWeights
from rlserve.worker.vllm_compat import BUFFERS, CHILDREN, MODULE_TABLES, PARAMETERS, TENSOR_TABLES, set_table, table

# A shadow has its own tensor and child tables (vllm_compat.MODULE_TABLES); everything else in
# its __dict__ is shared with the served module until the commit moves it over.
_MISSING = object()


class ShadowUpdate:
    """One update session's shadows. Not thread-safe: one caller at a time (the receiver)."""

    def __init__(self, model: torch.nn.Module, served: ServedWeights, *, in_place: bool = False) -> None:
        self._served = served
        self._in_place = in_place
        self._live = dict(model.named_modules())
        memo: dict[int, torch.nn.Module] = {}
        self._root = _shadow_tree(model, memo)
        self._shadow = {name: memo[id(module)] for name, module in self._live.items()}
        self._arrived: set[str] = set()
        self._processed: set[str] = set()
        # Processed shadows waiting for the commit, by served module name.
        self._ready: dict[str, torch.nn.Module] = {}
        # Something went live: the served digests are stale from `close()` on.
        self._installed = False
        # Per layer loaded: the bytes its shadows hold beside the served model.
        self._held: dict[str, int] = {}
        # Served tensors the commit replaced, freed after it (`close`), not under the pause.
        self._retired: list[torch.Tensor] = []

    def served_value(self, name: str) -> torch.Tensor:
        """A checkpoint tensor as the model serves it now (what a patch applies to)."""
        return self._served.value(name)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load checked tensors (checkpoint names) into the shadows; process every layer that
        is now complete (and install it, in place). The tensors may be reused afterwards."""
        if not tensors:
            return
        vllm_compat.load_checkpoint_weights(self._root, tensors)
        self._arrived.update(tensors)
        touched = sorted({self._served.layer_of(name) for name in tensors})
        for layer in touched:
            if self._served.members(layer) <= self._arrived:
                self._process(layer)
        for layer in touched:
            self._held[layer] = self._layer_bytes(layer)

    def prepare(self) -> int:
        """Complete partly sent layers from the served weights and process them, so that
        only the swap is left; returns how many checkpoint tensors the update sets or keeps.
        Idempotent."""
        if {self._served.layer_of(name) for name in self._arrived} - self._processed:
            # vLLM loads a layer whole: the members not sent carry their served values.
            self.load(self._served.complete(self._arrived))
        return len(self._arrived)

    def commit(self) -> int:
        """Prepare (if not yet done) and install every shadow; returns `prepare()`'s count."""
        count = self.prepare()
        self._install(list(self._ready))
        return count

    def held_bytes(self) -> int:
        """The bytes of the tensors the shadows hold now beside the served model, as of the
        last load (each load counts the layers it touched)."""
        return sum(self._held.values())

    @property
    def went_live(self) -> bool:
        """Whether any layer of this update was installed (in place, or by the commit)."""
        return self._installed

    def close(self) -> None:
        """Drop every shadow now. They hold references to the served modules' old state (a
        CPU kernel of the old weights) and, through their tensors' weight loaders, cycles a
        garbage collection would free only some time later: a sync's worth of memory each."""
        for shadow in [*self._shadow.values(), *self._ready.values()]:
            shadow.__dict__.clear()
        self._shadow.clear()
        self._ready.clear()
        self._held.clear()
        if self._retired:
            _free_in_background(self._retired)
            self._retired = []
        if self._installed:
            self._served.invalidate()  # also what was digested while an install was under way

    # Building ----------------------------------------------------------------------------

    def _process(self, layer: str) -> None:
        shadow = self._shadow[layer]
        _fill_unloaded(shadow, self._live[layer], layer)
        if self._served.needs_processing(layer, self._live[layer]):
            vllm_compat.process_after_loading(shadow)
        done = [layer]
        self._ready[layer] = shadow
        self._processed.add(layer)
        for alias, alias_param, owner_param in self._served.aliases_of(layer):
            # A module serving this layer's tensor (a tied lm_head): its own processing of it.
            served = self._live[alias]
            tied = copy.copy(served)
            own = {**table(served, PARAMETERS), alias_param: table(shadow, PARAMETERS)[owner_param]}
            set_table(tied, PARAMETERS, own)
            set_table(tied, BUFFERS, dict(table(served, BUFFERS)))
            if self._served.needs_processing(alias, served):
                vllm_compat.process_after_loading(tied)
            self._ready[alias] = tied
            done.append(alias)
        if self._in_place:
            self._install(done)
            # Live now: the shadow's tensors are not needed (no later tensor loads into it).
            for name in TENSOR_TABLES:
                set_table(shadow, name, {})

    def _layer_bytes(self, layer: str) -> int:
        """What one layer's shadows (its own and its aliases') hold: distinct written storages
        the served layer does not share (a shadow tensor stays on the meta device until loaded),
        and what their packed CPU kernels hold, which no tensor shows."""
        aliases = [a for a, _, _ in self._served.aliases_of(layer) if a in self._ready]
        served = {s.data_ptr() for s in _storages(self._live[layer])}
        modules = [self._shadow[layer], *(self._ready[a] for a in aliases)]
        held = {s.data_ptr(): s.nbytes() for m in modules for s in _storages(m)}
        packed = sum(self._packed_bytes(name) for name in (layer, *aliases) if name in self._ready)
        return sum(n for ptr, n in held.items() if ptr not in served) + packed

    def _packed_bytes(self, name: str) -> int:
        """The weight a processed shadow's CPU kernel packed into memory of its own (vLLM's
        oneDNN copy: out x in elements of the layer's dtype), or 0 where the kernel computes
        with the parameter, a tensor already counted. Without it a sync of SmolLM2 in bf16
        reported 57 MB of shadows for the 269 MB it held."""
        module = self._ready[name]
        if not callable(getattr(module, "cpu_linear", None)) or not self._served.needs_processing(
            name, self._live[name]
        ):
            return 0
        try:
            out_features, in_features = vllm_compat.kernel_shape(module)
            return out_features * in_features * vllm_compat.kernel_weight(module).element_size()
        except WorkerError:  # a kernel of a kind rlserve cannot size: an account, never a failed sync
            return 0

    def _install(self, layers: list[str]) -> None:
        copied: set[int] = set()
        together = _replaced_together([(self._live[layer], self._ready[layer]) for layer in layers])
        # In place, one layer at a time: each replaced layer is freed at once (the mode's
        # point is one layer of extra memory).
        retired = [] if self._in_place else self._retired
        self._installed = self._installed or bool(layers)
        try:
            for layer in layers:
                _install(self._live[layer], self._ready.pop(layer), copied, together, retired)
        finally:
            if layers:
                self._served.invalidate()


def _storages(module: torch.nn.Module) -> list[torch.UntypedStorage]:
    """The written storages of a module's own tensors (its tables and its attributes)."""
    tensors = [*table(module, PARAMETERS).values(), *table(module, BUFFERS).values()]
    tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return [t.untyped_storage() for t in tensors if t is not None and t.device.type != "meta"]


def _shadow_tree(module: torch.nn.Module, memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """A shallow copy of `module` and its children with tensors of their own, on the meta
    device until a weight loader writes them."""
    found = memo.get(id(module))
    if found is not None:
        return found
    shadow = copy.copy(module)
    memo[id(module)] = shadow
    children = {
        name: None if child is None else _shadow_tree(child, memo) for name, child in table(module, CHILDREN).items()
    }
    set_table(shadow, CHILDREN, children)
    vllm_compat.copy_buffer_persistence(shadow, module)
    params, buffers, device = _model_format(module)
    set_table(shadow, PARAMETERS, {n: _lazy(shadow, module, PARAMETERS, n, t, device) for n, t in params.items()})
    set_table(shadow, BUFFERS, {n: _lazy(shadow, module, BUFFERS, n, t, device) for n, t in buffers.items()})
    return shadow


def _model_format(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.device]:
    """The module's tensors as the checkpoint loads them (vLLM's record from model load),
    and those it did not record (a bias, added after the weights were created) as served."""
    recorded_params, recorded_buffers, device = vllm_compat.recorded_format(module)
    params = {n: t for n, t in table(module, PARAMETERS).items() if t is not None}
    buffers = {n: t for n, t in table(module, BUFFERS).items() if t is not None}
    return {**params, **recorded_params}, {**buffers, **recorded_buffers}, device


def _lazy(
    shadow: torch.nn.Module,
    live: torch.nn.Module,
    kind: str,
    name: str,
    template: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """A meta stand-in for one of `shadow`'s tensors whose weight loader gives it memory of
    its own on first use, then loads into that."""
    meta = _like(template, "meta", shadow, live)
    original = vllm_compat.weight_loader_of(meta)
    signature = _signature(original)
    target = "param" if "param" in signature.parameters else next(iter(signature.parameters))

    def load_into_shadow(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        tensors = table(shadow, kind)
        real = tensors[name]
        if real.is_meta:
            real = _like(meta, device, shadow, live)
            vllm_compat.set_weight_loader(real, original)
            tensors[name] = real
        bound.arguments[target] = real
        return original(*bound.args, **bound.kwargs)

    vllm_compat.set_weight_loader(meta, load_into_shadow)
    return meta


# A loader's signature, by its function: inspect builds one in 0.1 ms, 300 times a sync.
_SIGNATURES: weakref.WeakKeyDictionary[Any, inspect.Signature] = weakref.WeakKeyDictionary()


def _signature(loader: Any) -> inspect.Signature:
    """`inspect.signature(loader)`, remembered per function (a bound method: per function
    and bound, its first parameter dropped), for as long as the function lives."""
    function = loader.__func__ if isinstance(loader, MethodType) else loader
    try:
        signature = _SIGNATURES.get(function)
    except TypeError:  # not weakly referable or not hashable: not remembered
        return inspect.signature(loader)
    if signature is None:
        signature = _SIGNATURES[function] = inspect.signature(function)
    if function is not loader:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def _like(
    template: torch.Tensor, device: torch.device | str, shadow: torch.nn.Module, live: torch.nn.Module
) -> torch.Tensor:
    """An uninitialized tensor shaped as `template`, of its class and with its attributes;
    methods bound to the served module (or to vLLM's placeholder for it) bound to `shadow`."""
    tensor = torch.empty_strided(tuple(template.size()), tuple(template.stride()), dtype=template.dtype, device=device)
    tensor.__class__ = template.__class__
    tensor.__dict__ = dict(template.__dict__)
    return vllm_compat.restore_layer_refs(_bound_to(tensor, live, shadow), shadow)


def _free_in_background(tensors: list[torch.Tensor]) -> None:
    """Drop `tensors` from a thread of its own, one at a time, letting other threads run in
    between: freeing the replaced weights of SmolLM2 in bf16 took 7-10 ms of a 20-25 ms commit
    on a 2-core AVX2 CPU, all of it under the pause."""

    def free() -> None:
        while tensors:
            tensors.pop()
            time.sleep(0)  # hands the GIL to the engine's thread, if it waits for it

    threading.Thread(target=free, name="rlserve-free-replaced", daemon=True).start()


def _bound_to(tensor: torch.Tensor, old: torch.nn.Module, new: torch.nn.Module) -> torch.Tensor:
    """`tensor`, its methods bound to `old` (its weight loader) bound to `new`: a shadow's
    tensor loads into the shadow, and once served into the served module (by the next
    update's shadow too)."""
    for key, value in list(vars(tensor).items()):
        if isinstance(value, MethodType) and value.__self__ is old:
            vars(tensor)[key] = value.__func__.__get__(new)
    return tensor


def _fill_unloaded(shadow: torch.nn.Module, live: torch.nn.Module, layer: str) -> None:
    """A tensor of a complete layer that no checkpoint tensor wrote (a buffer the checkpoint
    does not carry) keeps its served value; one that has none cannot be built."""
    for kind in TENSOR_TABLES:
        tensors = table(shadow, kind)
        for name, tensor in tensors.items():
            if not tensor.is_meta:
                continue
            served = table(live, kind).get(name)
            if served is None or served.is_meta or served.shape != tensor.shape:
                raise WorkerError(ErrorCode.UNSUPPORTED, f"{layer}.{name} is not loaded by any checkpoint tensor")
            tensors[name] = served.detach().clone()


def _replaced_together(pairs: list[tuple[torch.nn.Module, torch.nn.Module]]) -> dict[int, int]:
    """Per served tensor (by id) that these (live, shadow) modules replace with one same new
    tensor wherever they hold it: in how many of their tables it sits. A tied lm_head and its
    embedding serve one tensor, and both get the shadow embedding's."""
    holders: dict[int, int] = {}
    replacement: dict[int, int] = {}
    for live, shadow in pairs:
        for served, name, new in _changes(live, shadow):
            old = served.get(name)
            if old is None:
                continue
            holders[id(old)] = holders.get(id(old), 0) + 1
            if replacement.setdefault(id(old), id(new)) != id(new):
                replacement[id(old)] = -1  # different replacements: it is not moved as one
    return {old: n for old, n in holders.items() if replacement[old] != -1}


def _changes(live: torch.nn.Module, shadow: torch.nn.Module) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    """(the served table, name, the shadow's tensor) for every tensor the shadow changes. It
    keeps no reference to the served tensor: the swap counts them."""
    for kind in TENSOR_TABLES:
        served = table(live, kind)
        for name, new in table(shadow, kind).items():
            if new is not None and new is not served.get(name):
                yield served, name, new


def _install(
    live: torch.nn.Module,
    shadow: torch.nn.Module,
    copied: set[int],
    together: dict[int, int],
    retired: list[torch.Tensor],
) -> None:
    """Make `live` serve what `shadow` holds. A served CPU tensor that only the modules being
    installed hold (`together`: in how many tables, each given the same new tensor) is
    replaced by the shadow's (no copy under the pause) and put in `retired` once no table of
    the install holds it, for the caller to free; one held elsewhere too (vLLM's, or a module
    not in this install) or on a GPU (a captured graph keeps its address) is written in
    place, once (`copied`: the served tensors written already)."""
    for served, name, new in _changes(live, shadow):
        old = served.get(name)
        # 3: this table's reference, `old` and getrefcount's own argument; then the other
        # tables of this install that will replace it too.
        if (
            old is not None
            and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
            and (old.device.type != "cpu" or sys.getrefcount(old) > 2 + together.get(id(old), 1))
        ):
            if id(old) not in copied:
                old.data.copy_(new)
                copied.add(id(old))
        else:
            if old is not None:
                left = together.get(id(old), 1) - 1  # tables of this install holding it still
                together[id(old)] = left
                if not left:
                    retired.append(old)
            served[name] = _bound_to(new, shadow, live)
    for key, value in shadow.__dict__.items():
        if key not in MODULE_TABLES and live.__dict__.get(key, _MISSING) is not value:
            live.__dict__[key] = value
