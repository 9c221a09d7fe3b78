"""Hugging Face TRL trains through rlserve, its loop unchanged: `install()` puts
`RlserveVLLMClient` where TRL's trainers look up `VLLMClient` (a context manager; `uninstall()`
undoes it), so `GRPOConfig(use_vllm=True, vllm_mode="server",
vllm_server_base_url="grpc://host:port")` generates and syncs through an rlserve server, on
the CPU too. `async_grpo` has the two protocols of TRL's AsyncGRPOTrainer. Tested with the
TRL of the `rlserve[trl]` extra. See docs/trl.md."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from rlserve.integrations.trl.client import Options, RlserveVLLMClient, target_of

__all__ = ["Options", "RlserveVLLMClient", "install", "target_of", "uninstall"]

# The modules whose `VLLMClient` TRL's trainers instantiate (others import it from there
# when they are built, or are patched below when already imported).
_CLIENT_MODULES = ("trl.generation.vllm_client", "trl.generation.vllm_generation")


class _Installation:
    """What `install()` replaced, to put back: (module, name, the original)."""

    def __init__(self, replaced: list[tuple[Any, str, Any]], client: type[RlserveVLLMClient]) -> None:
        self.replaced, self.client = replaced, client

    def __enter__(self) -> type[RlserveVLLMClient]:
        return self.client

    def __exit__(self, *exc: object) -> None:
        uninstall()


_installed: _Installation | None = None


def install(**options: Any) -> _Installation:
    """From now on TRL's trainers talk to rlserve (`with install(): ...` for a block only).
    `options` are `Options` fields (credentials, transport, timeouts, ...). Installing again
    replaces the options. Raises ImportError without TRL, TypeError for an unknown option."""
    uninstall()
    client = type("RlserveVLLMClient", (RlserveVLLMClient,), {"options": Options(**options)})
    modules = [importlib.import_module(name) for name in _CLIENT_MODULES]
    original = modules[0].VLLMClient
    replaced: list[tuple[Any, str, Any]] = []
    for module in [*modules, *(m for n, m in list(sys.modules.items()) if n.startswith("trl.") and m not in modules)]:
        if getattr(module, "VLLMClient", None) is original:
            replaced.append((module, "VLLMClient", original))
            setattr(module, "VLLMClient", client)  # noqa: B010  (TRL's module, not ours)
    generation = modules[1]
    if not generation.is_vllm_available():
        # Server mode needs no vLLM in the trainer's process with rlserve: TRL checks for it
        # all the same before it builds the client.
        replaced.append((generation, "is_vllm_available", generation.is_vllm_available))
        setattr(generation, "is_vllm_available", _available)  # noqa: B010
    global _installed
    _installed = _Installation(replaced, client)
    return _installed


def uninstall() -> None:
    """Puts back what `install()` replaced; nothing when nothing is installed."""
    global _installed
    installation, _installed = _installed, None
    if installation is not None:
        for module, name, original in reversed(installation.replaced):
            setattr(module, name, original)


def _available(*args: Any, **kwargs: Any) -> bool:
    return True
