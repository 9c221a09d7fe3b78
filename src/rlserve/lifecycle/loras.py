"""The LoRA adapters a server has loaded, by name: a name always means one set of weights
(upstream's worst LoRA bug in RL was a same-name reload that kept serving the old adapter
while rollouts were labelled with the new one), each load gets an engine id of its own, and
an adapter in use by running requests is not unloaded under them. At most as many adapters
are loaded as the engine keeps in its CPU cache: one evicted from there would be reloaded from
its directory, whatever that holds by then. No engine, no grpc."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

from rlserve.errors import InvalidRequest, NameTaken, NotFound, Overloaded, WrongState
from rlserve.types import LoraAdapter

MAX_PATH_BYTES = 4096
ADAPTER_CONFIG = "adapter_config.json"
# vLLM caches adapters by id: ids are never reused within the process, whichever server loads.
_IDS = itertools.count(1)


def adapter_digest(path: Path) -> str:
    """Of every file of the adapter directory (names and bytes): what "the same adapter" means."""
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def check_source(name: str, source_path: str, max_name_bytes: int) -> Path:
    if not name:
        raise InvalidRequest("lora_name", "is empty")
    if len(name.encode()) > max_name_bytes:
        raise InvalidRequest("lora_name", f"is longer than {max_name_bytes} bytes")
    if not source_path or len(source_path.encode()) > MAX_PATH_BYTES:
        raise InvalidRequest("source_path", f"needs a directory path of at most {MAX_PATH_BYTES} bytes")
    path = Path(source_path)
    if not (path / ADAPTER_CONFIG).is_file():
        raise InvalidRequest("source_path", f"{source_path!r} is no adapter directory (no {ADAPTER_CONFIG})")
    return path


class LoraRegistry:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._by_name: dict[str, LoraAdapter] = {}
        self._in_use: dict[str, int] = {}

    def get(self, name: str) -> LoraAdapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise InvalidRequest("lora_name", f"no adapter {name!r} is loaded; LoadLora it first")
        return adapter

    def adapters(self) -> tuple[LoraAdapter, ...]:
        return tuple(self._by_name.values())

    def existing(self, name: str, source_path: str, digest: str) -> LoraAdapter | None:
        """The adapter loaded under `name` when it is this one; None when the name is free.
        Raises NameTaken when the name stands for other weights."""
        adapter = self._by_name.get(name)
        if adapter is None:
            if len(self._by_name) >= self._capacity:
                raise Overloaded(f"{self._capacity} adapters are loaded, as many as the engine keeps; unload one first")
            return None
        if adapter.source_path != source_path or adapter.digest != digest:
            raise NameTaken(
                f"adapter {name!r} is loaded from other weights ({adapter.source_path}); a name means one set "
                "of weights: unload it first, or load the new weights under a new name"
            )
        return adapter

    def new(self, name: str, source_path: str, digest: str) -> LoraAdapter:
        return LoraAdapter(next(_IDS), name, source_path, digest)

    def add(self, adapter: LoraAdapter) -> None:
        self._by_name[adapter.lora_name] = adapter

    def removable(self, name: str) -> LoraAdapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise NotFound(f"no adapter {name!r} is loaded")
        if self._in_use.get(name):
            raise WrongState(f"adapter {name!r} is in use by {self._in_use[name]} running requests; abort them first")
        return adapter

    def remove(self, name: str) -> None:
        self._by_name.pop(name, None)

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[LoraAdapter]:
        """For the life of one request: the adapter cannot be unloaded meanwhile."""
        adapter = self.get(name)
        self._in_use[name] = self._in_use.get(name, 0) + 1
        try:
            yield adapter
        finally:
            self._in_use[name] -= 1
            if not self._in_use[name]:
                del self._in_use[name]
