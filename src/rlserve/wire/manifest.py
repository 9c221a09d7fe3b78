"""The checkpoint manifest: every tensor name with its dtype and shape, read from the
safetensors headers of a Hugging Face model directory (no tensor data is read).

Weight updates are checked against it: a name the checkpoint lacks or a wrong shape is
refused before any byte moves; so are LoRA adapters, from disk or pushed by a trainer.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class ManifestEntry:
    dtype_name: str
    shape: tuple[int, ...]


# A safetensors header lists names, dtypes, shapes and offsets: a few MB for the largest models.
MAX_HEADER_BYTES = 100 << 20


def read_manifest(model_dir: str | Path) -> dict[str, ManifestEntry]:
    """Raises FileNotFoundError when there are no weight files, ValueError for a malformed one
    (never blocks: only regular files are opened)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    manifest: dict[str, ManifestEntry] = {}
    for path in files:
        if not path.is_file():  # a directory, a FIFO (open would block), a device
            raise ValueError(f"{path.name} is not a regular file")
        manifest.update(_header_entries(path))
    return manifest


def _header_entries(path: Path) -> dict[str, ManifestEntry]:
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path.name}: too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name}: a header of {header_len} bytes is no safetensors header")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{path.name}: the header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: the header is not a JSON object")
    entries: dict[str, ManifestEntry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else (None, None)
        if not isinstance(dtype, str) or not isinstance(shape, list) or not all(_is_dim(d) for d in shape):
            raise ValueError(f"{path.name}: {name[:100]!r} has no valid dtype and shape")
        entries[name] = ManifestEntry(SAFETENSORS_DTYPES.get(dtype, dtype.lower()), tuple(shape))
    return entries


def _is_dim(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40


_LORA_TENSOR = re.compile(r"base_model\.model\.(?P<base>.+)\.lora_(?P<part>[AB])\.weight")


def lora_tensor_misfit(
    name: str, shape: tuple[int, ...], checkpoint: Mapping[str, ManifestEntry], max_rank: int
) -> str:
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


def lora_misfit(tensors: Mapping[str, ManifestEntry], checkpoint: Mapping[str, ManifestEntry], max_rank: int) -> str:
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


def lora_config_misfit(config: Mapping[str, Any], tensors: Mapping[str, ManifestEntry]) -> str:
    """What in an adapter_config contradicts its tensors: its rank `r` (unless a rank_pattern
    sets ranks per layer) and a finite `lora_alpha` (the scale is alpha / r)."""
    rank = config.get("r")
    if not config.get("rank_pattern"):
        ranks = {e.shape[0] for n, e in tensors.items() if n.endswith(".lora_A.weight") and len(e.shape) == 2}
        if not isinstance(rank, int) or isinstance(rank, bool) or ranks != {rank}:
            return f"adapter_config r={rank!r} but the tensors have rank {sorted(ranks)}"
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or abs(alpha) > 1e6:
        return f"adapter_config lora_alpha={alpha!r} is no usable scale"
    return ""


def lora_files_misfit(adapter_dir: Path, checkpoint: Mapping[str, ManifestEntry], max_rank: int) -> str:
    """What is wrong with an adapter directory on disk against the served checkpoint: its
    tensors' headers, then its adapter_config.json (one vLLM cannot read is left for vLLM to
    name). Raises OSError / ValueError when there are no readable adapter weights."""
    tensors = read_manifest(adapter_dir)
    problem = lora_misfit(tensors, checkpoint, max_rank)
    if problem:
        return problem
    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return ""
    return lora_config_misfit(config, tensors) if isinstance(config, dict) else ""
