"""The checkpoint manifest: every tensor name with its dtype and shape, read from the
safetensors headers of a Hugging Face model directory (no tensor data is read).

Weight updates are checked against it: a name the checkpoint lacks or a wrong shape is
refused before any byte moves.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class ManifestEntry:
    dtype_name: str
    shape: tuple[int, ...]


def read_manifest(model_dir: str | Path) -> dict[str, ManifestEntry]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    manifest: dict[str, ManifestEntry] = {}
    for path in files:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"].lower())
            manifest[name] = ManifestEntry(dtype, tuple(entry["shape"]))
    return manifest
