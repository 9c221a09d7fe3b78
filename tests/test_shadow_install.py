"""The commit's swap (`rlserve.worker.shadow._install`) on plain torch modules, no engine: a
served CPU tensor that only its module holds is replaced by the shadow's (nothing copied
under the pause), one that something else holds too is written in place, and the new
tensor's weight loader writes the served module from then on. A tensor that two modules of
one install serve (a tied head and its embedding) is replaced in both."""

from __future__ import annotations

import copy

import torch

from rlserve.worker.shadow import _install, _replaced_together


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
    _install(live, shadow, set(), {})
    assert live.weight is new_weight and live.norm is new_norm
    assert torch.equal(live.weight, torch.full((4, 3), 7.0))
    # Its loader now writes the served module's tensor (the next update's shadow starts there).
    assert live.weight.weight_loader.__self__ is live


def test_a_tensor_held_elsewhere_too_is_written_in_place_once():
    live, head = Layer(), torch.nn.Module()
    served = live.weight
    head.weight = served  # a tied head serves the same tensor
    shadow = shadow_of(live)
    copied: set[int] = set()
    _install(live, shadow, copied, {})
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


def install(*pairs: tuple[torch.nn.Module, torch.nn.Module]) -> set[int]:
    copied: set[int] = set()
    together = _replaced_together(list(pairs))
    for live, shadow in pairs:
        _install(live, shadow, copied, together)
    return copied


def test_a_tensor_that_the_install_replaces_everywhere_it_is_served_is_replaced_not_copied():
    live, head, shadow, head_shadow = tied_pair()
    new_weight = shadow._parameters["weight"]
    assert install((live, shadow), (head, head_shadow)) == set()
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
