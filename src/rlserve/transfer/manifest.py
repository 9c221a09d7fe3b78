"""The checkpoint manifest: every tensor name with its dtype and shape, read from the
safetensors headers of a Hugging Face model directory (no tensor data is read).

Weight updates are checked against it: a name the checkpoint lacks or a wrong shape is
refused before any byte moves; so are LoRA adapters, from disk or pushed by a trainer.
"""

from __future__ import annotations

import json
import re
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


_LORA_TENSOR = re.compile(r"base_model\.model\.(?P<base>.+)\.lora_(?P<part>[AB])\.weight")


def lora_tensor_misfit(name: str, shape: tuple[int, ...], checkpoint: dict[str, ManifestEntry], max_rank: int) -> str:
    """What is wrong with one adapter tensor (PEFT name, A: [r, in], B: [out, r]) for a
    checkpoint; empty when nothing is."""
    match = _LORA_TENSOR.fullmatch(name)
    if match is None:
        return f"{name}: not a LoRA A or B weight (base_model.model.<layer>.lora_A/B.weight)"
    base = checkpoint.get(f"{match['base']}.weight")
    if base is None or len(base.shape) != 2 or len(shape) != 2:
        return f"{name}: the model has no linear layer {match['base']}"
    out_features, in_features = base.shape
    rank, expected = (
        (shape[0], (shape[0], in_features)) if match["part"] == "A" else (shape[1], (out_features, shape[1]))
    )
    if tuple(shape) != expected:
        return f"{name}: shape {list(shape)}, the layer needs {list(expected)}"
    if not 0 < rank <= max_rank:
        return f"{name}: rank {rank} is outside 1..{max_rank} (--max-lora-rank)"
    return ""


def lora_misfit(tensors: dict[str, ManifestEntry], checkpoint: dict[str, ManifestEntry], max_rank: int) -> str:
    """What is wrong with a whole adapter: each tensor, and each layer's A and B of one rank."""
    ranks: dict[str, dict[str, int]] = {}
    for name, entry in sorted(tensors.items()):
        problem = lora_tensor_misfit(name, entry.shape, checkpoint, max_rank)
        if problem:
            return problem
        match = _LORA_TENSOR.fullmatch(name)
        assert match is not None
        ranks.setdefault(match["base"], {})[match["part"]] = entry.shape[0] if match["part"] == "A" else entry.shape[1]
    for base, parts in ranks.items():
        if set(parts) != {"A", "B"} or parts["A"] != parts["B"]:
            return f"{base}: needs lora_A and lora_B of one rank, has {parts}"
    return "" if ranks else "the adapter has no LoRA weights"
