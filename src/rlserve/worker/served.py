"""The weights a vLLM model actually serves, in checkpoint names, read back from the model.

vLLM fuses checkpoint tensors (q/k/v into qkv_proj, gate/up into gate_up_proj), pads the
vocabulary, ties the lm_head to the embedding, and on CPU packs each linear layer's weight
into an opaque GEMM kernel and drops the parameter (where it cannot pack, bf16 on a CPU
without AVX-512 BF16, the kernel computes with the parameter itself). A `Site` is one place
that serves (a row range of) a checkpoint tensor; reading it undoes fusion and padding, and
reads a packed layer through its own kernel (an identity matrix times W is W exactly), so a
digest describes what the model computes with, not what was sent. Dense (unquantized) layers with tensor parallel
size 1 only; anything else is refused rather than described wrongly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from rlserve.wire.protocol import ErrorCode, WorkerError, combined_checksum, tensor_checksum
from rlserve.worker import vllm_compat

# Rows of the identity fed to a packed kernel at once: at most PROBE_BLOCK_ELEMENTS elements
# of scratch, and about PROBE_BLOCK_MACS multiply-adds (5 ms on one core of an AVX-512 BF16
# CPU), but never under PROBE_MIN_ROWS, below which a GEMM rereads its packed weight for too
# few rows (SmolLM2's lm_head: 35 multiply-adds per ns at 4 rows, 97 at 64, 106 at 256).
PROBE_BLOCK_ELEMENTS = 1 << 24
PROBE_BLOCK_MACS = 1 << 29
PROBE_MIN_ROWS = 64


@dataclass(frozen=True)
class Site:
    checkpoint_name: str
    module_name: str
    module: torch.nn.Module
    param_name: str
    rows: slice | None
    # Read through the module's compute kernel (CPU packed GEMM) rather than the parameter.
    via_kernel: bool
    # A second place serving a tensor another site loads (a tied lm_head): checked, never loaded.
    is_alias: bool = False


class ServedWeights:
    def __init__(self, model: torch.nn.Module, checkpoint_names: Iterable[str], tensor_parallel_size: int) -> None:
        if tensor_parallel_size != 1:
            raise WorkerError(ErrorCode.UNSUPPORTED, "served-weight digests need tensor_parallel_size 1")
        self._names = frozenset(checkpoint_names)
        if vllm_compat.is_wrapped_for_lora(model):
            raise WorkerError(
                ErrorCode.UNSUPPORTED,
                "the base weights of a server started with --enable-lora cannot be updated or digested "
                "(vLLM wraps its layers for LoRA); push LoRA adapters, or serve without --enable-lora",
            )
        self._sites = _find_sites(model, self._names)
        missing = sorted(self._names - self._sites.keys())
        if missing:
            raise WorkerError(
                ErrorCode.UNSUPPORTED,
                f"cannot find checkpoint tensors {missing[:5]} among the served parameters",
            )
        # The layer (served module) each checkpoint tensor loads into, and each layer's tensors.
        self._layer = {name: self._loaded_site(name).module_name for name in self._names}
        members: dict[str, set[str]] = {}
        for name, layer in self._layer.items():
            members.setdefault(layer, set()).add(name)
        self._members = {layer: frozenset(names) for layer, names in members.items()}
        self._aliases: dict[str, list[tuple[str, str, str]]] = {}
        for name, sites in self._sites.items():
            loaded = self._loaded_site(name)
            for site in sites:
                if site.is_alias:
                    entry = (site.module_name, site.param_name, loaded.param_name)
                    self._aliases.setdefault(loaded.module_name, []).append(entry)
        self._kernel_holds_no_weights: dict[str, bool] = {}
        self._digests: dict[str, str] = {}
        self._inconsistent: set[str] = set()
        self._work: Iterator[None] | None = None  # the digest pass under way
        # Digests are taken on the engine loop; an in-place update invalidates them from its
        # transfer thread.
        self._lock = threading.Lock()

    # Digests -----------------------------------------------------------------------------

    def invalidate(self) -> None:
        """The served weights changed (a commit); digest everything again on next use."""
        with self._lock:
            self._start_over()

    def _start_over(self) -> None:
        self._digests.clear()
        self._inconsistent.clear()
        self._work = None

    def advance(self, budget_s: float) -> bool:
        """Digest until `budget_s` is spent; True once every tensor is digested. Run between
        engine steps, so generation goes on while a large model is digested: a slice ends
        with the piece of work (a few ms) under way at its deadline. A pass that fails (a
        kernel that cannot be read, memory) starts over at the next call, never to report
        done without the tensors it had left."""
        with self._lock:
            if self._work is None:
                self._work = self._digest_pass()
            deadline = time.monotonic() + budget_s
            try:
                for _ in self._work:
                    if time.monotonic() >= deadline:
                        return False
            except BaseException:
                self._start_over()
                raise
            return True

    def _digest_pass(self) -> Iterator[None]:
        """Digest every checkpoint tensor, pausing (a `yield`) after each piece of work: a
        block of a packed layer's read, a tensor's digest. The places that serve tensors are
        taken module by module, so a packed layer is read once for all the tensors fused into
        it (q, k and v; gate and up), not once per tensor."""
        by_module: dict[str, list[Site]] = {}
        for sites in self._sites.values():
            for site in sites:
                by_module.setdefault(site.module_name, []).append(site)
        found: dict[str, set[str]] = {name: set() for name in self._names}
        for sites in by_module.values():
            kernel: torch.Tensor | None = None  # W as this module's kernel computes it, once read
            for site in sites:
                if not site.via_kernel:
                    tensor = self.read(site)
                else:
                    if kernel is None:
                        kernel = yield from _read_kernel_in_pieces(site.module)
                    tensor = _rows(kernel, site.rows)
                found[site.checkpoint_name].add(tensor_checksum(tensor))
                yield
        for name, digests in found.items():
            if len(digests) == 1:
                self._digests[name] = digests.pop()
            else:
                # The places serving this tensor disagree: no single tensor describes it.
                self._inconsistent.add(name)
                self._digests[name] = combined_checksum({str(i): d for i, d in enumerate(sorted(digests))})

    @property
    def digests(self) -> Mapping[str, str]:
        return self._digests

    @property
    def inconsistent(self) -> frozenset[str]:
        return frozenset(self._inconsistent)

    # Loading support ---------------------------------------------------------------------

    def layer_of(self, name: str) -> str:
        """The served module a checkpoint tensor loads into."""
        return self._layer[name]

    def members(self, layer: str) -> frozenset[str]:
        """The checkpoint tensors that load into a served module."""
        return self._members[layer]

    def aliases_of(self, layer: str) -> list[tuple[str, str, str]]:
        """(module, its parameter, `layer`'s parameter) for each other module that serves a
        tensor of `layer` (a tied lm_head shares the embedding's weight)."""
        return self._aliases.get(layer, [])

    def needs_processing(self, layer: str, module: torch.nn.Module) -> bool:
        """Whether a shadow of the served module `layer` (`module`) goes through vLLM's
        processing after loading. Not where the served kernel computes with the weight it is
        called with:
        vLLM picks a layer's kernel by its shape and dtype, which an update keeps, so it
        would pick that one again, after failing to pack (1 ms a layer on a CPU without
        native bf16), and that kernel holds nothing of the weights. Probed once per layer
        (0.25 ms each, a SmolLM2 sync's 30 ms); a kernel replaced behind rlserve's back
        still shows in the digests, which probe every time."""
        holds_none = self._kernel_holds_no_weights.get(layer)
        if holds_none is None:
            holds_none = vllm_compat.kernel_holds_no_weights(module)
            self._kernel_holds_no_weights[layer] = holds_none
        return not holds_none

    def complete(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The served values of every checkpoint tensor that shares a layer with `names` but is
        not among them: vLLM loads a layer as a whole, so a partial update of a fused layer
        must carry its other members as they are served now."""
        given = set(names)
        layers = {self._layer[n] for n in given if n in self._layer}
        missing = {m for layer in layers for m in self._members[layer]} - given
        return {name: self.value(name) for name in sorted(missing)}

    def value(self, name: str) -> torch.Tensor:
        """A copy of one checkpoint tensor as the model serves it now."""
        return self.read(self._loaded_site(name)).clone()

    def _loaded_site(self, name: str) -> Site:
        return next(site for site in self._sites[name] if not site.is_alias)

    @staticmethod
    def read(site: Site) -> torch.Tensor:
        module = site.module
        return _rows(_read_kernel(module) if site.via_kernel else getattr(module, site.param_name).detach(), site.rows)


def _rows(tensor: torch.Tensor, rows: slice | None) -> torch.Tensor:
    return tensor[rows] if rows is not None else tensor


def _find_sites(model: torch.nn.Module, names: frozenset[str]) -> dict[str, list[Site]]:
    def site(
        name: str,
        module_name: str,
        module: torch.nn.Module,
        param_name: str,
        rows: slice | None,
        is_alias: bool = False,
    ) -> Site:
        if rows is None:
            rows = vllm_compat.served_vocabulary_rows(module)
        via_kernel = param_name == "weight" and vllm_compat.has_packed_kernel(module)
        return Site(name, module_name, module, param_name, rows, via_kernel, is_alias)

    packed = vllm_compat.fused_members(model)
    sites: dict[str, list[Site]] = {}
    loaded_by: dict[int, str] = {}  # id(parameter) -> the checkpoint tensor loaded into it
    unclaimed: list[tuple[str, torch.nn.Module, str, torch.nn.Parameter]] = []
    for module_name, module in model.named_modules():
        if vllm_compat.is_quantized(module):
            raise WorkerError(ErrorCode.UNSUPPORTED, f"{module_name} is quantized; its weights cannot be digested")
        prefix, _, last = module_name.rpartition(".")
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}"
            if last in packed:
                members = packed[last]
                offset = 0
                for member, size in zip(members, _output_sizes(module, len(members), module_name)):
                    name = ".".join(filter(None, (prefix, member, param_name)))
                    rows = slice(offset, offset + size)
                    sites.setdefault(name, []).append(site(name, module_name, module, param_name, rows))
                    offset += size
                loaded_by.setdefault(id(param), full)
            elif full in names:
                sites.setdefault(full, []).append(site(full, module_name, module, param_name, None))
                loaded_by.setdefault(id(param), full)
            else:
                unclaimed.append((module_name, module, param_name, param))
    # A parameter shared with one that a checkpoint tensor loads (a tied lm_head) serves it too.
    for module_name, module, param_name, param in unclaimed:
        owner = loaded_by.get(id(param))
        if owner in sites:
            sites[owner].append(site(owner, module_name, module, param_name, None, is_alias=True))
    return {name: s for name, s in sites.items() if name in names}


def _output_sizes(module: torch.nn.Module, num_members: int, module_name: str) -> list[int]:
    sizes = vllm_compat.fused_output_sizes(module)
    if len(sizes) != num_members:
        raise WorkerError(ErrorCode.UNSUPPORTED, f"cannot split the fused layer {module_name} into its members")
    return sizes


def _read_kernel(module: torch.nn.Module) -> torch.Tensor:
    """W (out x in) as the layer's kernel computes it, in one go."""
    reading = _read_kernel_in_pieces(module)
    while True:
        try:
            next(reading)
        except StopIteration as done:
            result: torch.Tensor = done.value
            return result


def _read_kernel_in_pieces(module: torch.nn.Module) -> Generator[None, None, torch.Tensor]:
    """W (out x in) as the layer's kernel computes it (the generator's value), pausing between
    pieces of a few ms: the weight it is called with where it computes from that (vLLM's
    unpacked bf16 layers on a CPU without native bf16, through which the identity would take
    a minute for SmolLM2), else rows of the identity through it (in^2 * out multiply-adds:
    0.18 s for SmolLM2's lm_head on one core with AVX-512 BF16), which give W's transpose a
    block of rows at a time."""
    weight = vllm_compat.kernel_weight(module)
    out_features, in_features = vllm_compat.kernel_shape(module)
    if weight.shape == (out_features, in_features) and vllm_compat.kernel_computes_with_its_argument(module, weight):
        return weight.detach()
    transposed = torch.empty(in_features, out_features, dtype=weight.dtype)
    block = min(
        in_features,
        max(PROBE_MIN_ROWS, PROBE_BLOCK_MACS // (in_features * out_features)),
        max(1, PROBE_BLOCK_ELEMENTS // max(out_features, in_features)),
    )
    with torch.no_grad():
        for start in range(0, in_features, block):
            stop = min(in_features, start + block)
            eye = torch.zeros(stop - start, in_features, dtype=weight.dtype)
            eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
            transposed[start:stop] = vllm_compat.run_packed_kernel(module, eye, weight)
            yield
    # One piece: torch transposes a whole matrix in blocks (30 ms for the lm_head here), a
    # slice of one element by element (five times that).
    return transposed.t().contiguous()
