"""The commit's swap (`rlserve.worker.shadow._install`) on plain torch modules, no engine: a
served CPU tensor that only its module holds is replaced by the shadow's (nothing copied
under the pause), one that something else holds too is written in place, and the new
tensor's weight loader writes the served module from then on. A tensor that two modules of
one install serve (a tied head and its embedding) is replaced in both."""

from __future__ import annotations

import copy
import time
import weakref

import torch

from rlserve.worker.shadow import _free_in_background, _install, _replaced_together


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.weight.weight_loader = self.load  # as vLLM binds a parameter's loader to its layer

    def load(self, param: torch.Tensor, value: torch.Tensor) -> None:
        param.data.copy_(value)


def shadow_of(live: Layer) -> Layer:
    """A shadow as the update builds one: a shallow copy with tensors of its own, their
    loaders bound to the shadow."""
    shadow = copy.copy(live)
    shadow._parameters = {}
    for name, served in live._parameters.items():
        new = torch.nn.Parameter(torch.full_like(served, 7.0), requires_grad=False)
        if hasattr(served, "weight_loader"):
            new.weight_loader = shadow.load
        shadow._parameters[name] = new
    return shadow


def test_a_tensor_only_its_module_holds_is_replaced_not_copied():
    live = Layer()
    shadow = shadow_of(live)
    new_weight, new_norm = shadow._parameters["weight"], shadow._parameters["norm"]
    old = [id(live.weight), id(live.norm)]  # ids only: a reference held here would count as a holder
    retired: list[torch.Tensor] = []
    _install(live, shadow, set(), {}, retired)
    assert live.weight is new_weight and live.norm is new_norm
    # The replaced tensors are the caller's to free (after the pause), not freed by the swap.
    assert [id(t) for t in retired] == old
    assert torch.equal(live.weight, torch.full((4, 3), 7.0))
    # Its loader now writes the served module's tensor (the next update's shadow starts there).
    assert live.weight.weight_loader.__self__ is live


def test_a_tensor_held_elsewhere_too_is_written_in_place_once():
    live, head = Layer(), torch.nn.Module()
    served = live.weight
    head.weight = served  # a tied head serves the same tensor
    shadow = shadow_of(live)
    copied: set[int] = set()
    _install(live, shadow, copied, {}, [])
    assert live.weight is served and head.weight is served and copied == {id(served)}
    assert torch.equal(served, torch.full((4, 3), 7.0))
    assert live.norm is shadow._parameters["norm"]  # held by its module alone: replaced


def tied_pair() -> tuple[Layer, torch.nn.Module, Layer, torch.nn.Module]:
    """An embedding-like layer and a head serving its weight, with their shadows as the update
    builds them: the head's shadow serves the embedding shadow's new tensor."""
    live, head = Layer(), torch.nn.Module()
    head.weight = live.weight
    shadow = shadow_of(live)
    head_shadow = copy.copy(head)
    head_shadow._parameters = {"weight": shadow._parameters["weight"]}
    return live, head, shadow, head_shadow


def install(*pairs: tuple[torch.nn.Module, torch.nn.Module], retired: list | None = None) -> set[int]:
    copied: set[int] = set()
    together = _replaced_together(list(pairs))
    for live, shadow in pairs:
        _install(live, shadow, copied, together, [] if retired is None else retired)
    return copied


def test_a_tensor_that_the_install_replaces_everywhere_it_is_served_is_replaced_not_copied():
    live, head, shadow, head_shadow = tied_pair()
    new_weight, old = shadow._parameters["weight"], [id(live.norm), id(live.weight)]
    retired: list[torch.Tensor] = []
    assert install((live, shadow), (head, head_shadow), retired=retired) == set()
    assert [id(t) for t in retired] == old  # the tied one once, when no table holds it any more
    assert live.weight is new_weight and head.weight is new_weight
    assert torch.equal(head.weight, torch.full((4, 3), 7.0))
    assert live.weight.weight_loader.__self__ is live


def test_a_tied_tensor_held_by_a_third_is_written_in_place_for_all():
    live, head, shadow, head_shadow = tied_pair()
    served = live.weight
    keeper = [served]  # as vLLM may keep a reference of its own
    assert install((live, shadow), (head, head_shadow)) == {id(served)}
    assert live.weight is served and head.weight is served and keeper[0] is served
    assert torch.equal(served, torch.full((4, 3), 7.0))


def test_replaced_tensors_are_freed_by_a_thread_after_the_swap():
    tensors = [torch.zeros(1000) for _ in range(3)]
    alive = [weakref.ref(t) for t in tensors]
    _free_in_background(tensors)
    deadline = time.monotonic() + 5
    while any(r() is not None for r in alive) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r() for r in alive] == [None, None, None] and tensors == []


def test_a_loaders_signature_is_remembered_per_function_and_bound_methods_drop_self():
    import inspect

    from rlserve.worker.shadow import _SIGNATURES, _signature

    one, two = Layer(), Layer()
    assert _signature(one.load) == inspect.signature(one.load)
    assert list(_signature(two.load).parameters) == ["param", "value"]
    assert Layer.load in _SIGNATURES  # one entry for every layer's bound loader

    def plain(param, loaded_weight, shard_id=None):
        pass

    assert _signature(plain) == inspect.signature(plain)
    unreferable = Slotted()
    assert _signature(unreferable) == inspect.signature(unreferable)  # answered, not remembered


class Slotted:
    """A loader no weak reference can point to."""

    __slots__ = ()

    def __call__(self, param, loaded_weight):
        pass
