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
from collections.abc import Callable, Iterator
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
        self._in_use: dict[int, int] = {}  # by lora_id
        # Replaced by a new version while requests still used them: unloaded after the last.
        self._retired: dict[int, LoraAdapter] = {}
        # Called with a retired adapter once no request uses it (the controller unloads it).
        self.on_retired: Callable[[LoraAdapter], None] = lambda adapter: None

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
            self.check_room()
            return None
        if adapter.source_path != source_path or adapter.digest != digest:
            raise NameTaken(
                f"adapter {name!r} is loaded from other weights ({adapter.source_path}); a name means one set "
                "of weights: unload it first, or load the new weights under a new name"
            )
        return adapter

    def check_new_version(self, name: str, new_version: bool) -> None:
        """Before a trainer pushes weights for `name`: a loaded name needs `new_version`."""
        if name in self._by_name:
            if not new_version:
                raise NameTaken(
                    f"adapter {name!r} is loaded with other weights; a name means one set of weights: "
                    "ask for a new version of it (new_version), or push under a new name"
                )
        else:
            self.check_room()

    def check_room(self) -> None:
        if len(self._by_name) + len(self._retired) >= self._capacity:
            raise Overloaded(f"{self._capacity} adapters are loaded, as many as the engine keeps; unload one first")

    def new(self, name: str, source_path: str, digest: str, version: str = "", owned_dir: str = "") -> LoraAdapter:
        return LoraAdapter(next(_IDS), name, source_path, digest, version, owned_dir)

    def add(self, adapter: LoraAdapter) -> LoraAdapter | None:
        """Serve `adapter` under its name from now on (requests already running keep the one
        they started with). Returns the adapter it replaces when nothing uses that any more
        (to unload now); one still in use is unloaded through `on_retired` after its last request."""
        old = self._by_name.get(adapter.lora_name)
        self._by_name[adapter.lora_name] = adapter
        if old is None:
            return None
        if self._in_use.get(old.lora_id):
            self._retired[old.lora_id] = old
            return None
        return old

    def removable(self, name: str) -> LoraAdapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise NotFound(f"no adapter {name!r} is loaded")
        if self._in_use.get(adapter.lora_id):
            raise WrongState(
                f"adapter {name!r} is in use by {self._in_use[adapter.lora_id]} running requests; abort them first"
            )
        return adapter

    def remove(self, name: str) -> None:
        self._by_name.pop(name, None)

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[LoraAdapter]:
        """For the life of one request: the adapter it started with stays loaded meanwhile."""
        adapter = self.get(name)
        key = adapter.lora_id
        self._in_use[key] = self._in_use.get(key, 0) + 1
        try:
            yield adapter
        finally:
            self._in_use[key] -= 1
            if not self._in_use[key]:
                del self._in_use[key]
                retired = self._retired.pop(key, None)
                if retired is not None:
                    self.on_retired(retired)
