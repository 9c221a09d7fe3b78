"""The trainer's side of a sync from a model on a CUDA GPU, no server needed (run it where
torch sees a GPU: `python benchmarks/gpu_trainer.py`).

A model of SmolLM2-135M's tensor shapes in fp32 on the GPU is planned for a bf16 server
(`rlserve.sdk.plan.plan_sync`: cast where the tensor lives, then moved to the host) and,
side by side in one run, the order it replaced (moved to the host in fp32, cast there). Both
must give the same bytes and digests. Prints one JSON line: seconds per plan of each, their
ratio, the bytes that cross to the host, and the GPU.
"""

from __future__ import annotations

import json
import time

import torch

from rlserve.sdk.plan import plan_sync
from rlserve.wire.protocol import TensorMeta, tensor_checksum

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 576, 1536, 30, 49152, 192


def smollm2_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV, HIDDEN),
            p + "self_attn.v_proj.weight": (KV, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return shapes


def host_cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The replaced order: every tensor to the host in its own dtype, cast there."""
    out = {}
    for name, t in tensors.items():
        out[name] = t.detach().to("cpu").to(dtype).contiguous()
    # The same digests the planner makes, so both legs do the same host work but the cast.
    [TensorMeta(n, "bfloat16", tuple(t.shape), tensor_checksum(t)) for n, t in out.items()]
    return out


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    model = {n: torch.randn(s, generator=g, device="cuda") for n, s in smollm2_shapes().items()}
    num_bytes = sum(t.nbytes for t in model.values())
    device_s, (sent, chunks) = timed(lambda: plan_sync(model, torch.bfloat16), 3)
    host_s, reference = timed(lambda: host_cast(model, torch.bfloat16), 3)
    same = all(torch.equal(sent[n].view(torch.int16), reference[n].view(torch.int16)) for n in model)
    same_digests = all(m.checksum == tensor_checksum(reference[m.name]) for c in chunks for m in c.tensors)
    print(
        json.dumps(
            {
                "bench": "gpu_trainer",
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "num_tensors": len(model),
                "fp32_bytes": num_bytes,
                "bytes_to_host": {"cast_on_device": num_bytes // 2, "cast_on_host": num_bytes},
                "plan_s": {"cast_on_device": round(device_s, 4), "cast_on_host": round(host_s, 4)},
                "host_over_device": round(host_s / device_s, 2),
                "same_bytes": same,
                "same_digests": same_digests,
            }
        )
    )


if __name__ == "__main__":
    main()
