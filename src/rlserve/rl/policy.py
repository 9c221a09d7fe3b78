"""The trainer's copy of the model: its optimizer, the version it is at, and the weights of the
versions just before it. Owns the optimizer step; not the loss, sampling or the sync."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlserve.rl.tasks import Problem

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Policy:
    """The trainer's model, its optimizer, the version it is at, and the weights of the last
    `keep_versions` versions before it (to re-score stale rollouts under the weights that
    sampled them)."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any, *, lr: float, keep_versions: int = 0) -> None:
        # transformers' `float()` is unannotated; it returns the model itself.
        self.model: PreTrainedModel = model.float().train()
        self.tokenizer = tokenizer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.version = 0
        self._keep = keep_versions
        self._history: dict[int, dict[str, torch.Tensor]] = {}
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def prompt_ids(self, problem: Problem) -> list[int]:
        turns = [{"role": "system", "content": problem.system}] if problem.system else []
        turns.append({"role": "user", "content": problem.question})
        ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def weights_of(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of an earlier version, if still kept."""
        return self._history.get(version)

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> None:
        """One optimizer step on `loss`; the version counts one up (publish it next)."""
        if self._keep:
            self._history[self.version] = _copy_weights(self.model)
            for old in [v for v in self._history if v <= self.version - self._keep]:
                del self._history[old]
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            self.optimizer.step()
        self.version += 1


def _copy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the state dict in which tied tensors (embedding and output head) stay one."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in copies:
            copies[tensor.data_ptr()] = tensor.detach().clone()
        out[name] = copies[tensor.data_ptr()]
    return out
