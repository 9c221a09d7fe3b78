"""Reading safetensors headers (the checkpoint manifest, and adapters checked against it) and
the adapter checks, with files a careless or hostile caller would hand in. No engine."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from rlserve.errors import InvalidRequest
from rlserve.wire.manifest import ManifestEntry, lora_config_misfit, lora_misfit, read_manifest


def header_file(path, header: bytes, length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header)


@pytest.mark.parametrize(
    "header,length",
    [
        (b"", 2**62),  # a length no header has (it was a MemoryError)
        (b"[]", None),  # not an object (AttributeError)
        (b"5", None),
        (b'{"a": "x"}', None),  # an entry that is not an object (TypeError)
        (b'{"a": {"dtype": 5, "shape": [1]}}', None),  # (AttributeError)
        (b'{"a": {"dtype": "F32", "shape": "[1]"}}', None),
        (b'{"a": {"dtype": "F32", "shape": [-1]}}', None),
        (b"\xff\xfe", None),
        (b"[" * 100000, None),
    ],
)
def test_a_malformed_header_is_a_value_error(tmp_path, header, length):
    header_file(tmp_path / "x.safetensors", header, length)
    with pytest.raises(ValueError):
        read_manifest(tmp_path)


def test_entries_that_are_not_regular_files_are_refused_without_opening_them(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        read_manifest(tmp_path)
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "x.safetensors")  # opening it would block forever
    with pytest.raises(ValueError, match="not a regular file"):
        read_manifest(fifo_dir)
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path / "nowhere")


def test_a_good_header_reads(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3, 4)}, str(tmp_path / "m.safetensors"))
    assert read_manifest(tmp_path) == {"w": ManifestEntry("float32", (3, 4))}


CHECKPOINT = {"model.layers.0.self_attn.q_proj.weight": ManifestEntry("float32", (128, 64))}
A, B = (
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"),
)


def test_adapter_tensors_must_fit_the_layers():
    good = {A: ManifestEntry("float32", (8, 64)), B: ManifestEntry("float32", (128, 8))}
    assert lora_misfit(good, CHECKPOINT, 8) == ""
    assert "the layer needs" in lora_misfit({**good, B: ManifestEntry("float32", (125, 8))}, CHECKPOINT, 8)
    assert "rank 8 is outside" in lora_misfit(good, CHECKPOINT, 4)
    assert "needs lora_A and lora_B" in lora_misfit({A: good[A]}, CHECKPOINT, 8)
    assert "no linear layer" in lora_misfit({A.replace("q_proj", "z_proj"): good[A]}, CHECKPOINT, 8)
    assert "no LoRA weights" in lora_misfit({}, CHECKPOINT, 8)


def test_the_adapter_config_must_agree_with_its_tensors():
    tensors = {A: ManifestEntry("float32", (8, 64)), B: ManifestEntry("float32", (128, 8))}
    assert lora_config_misfit({"r": 8, "lora_alpha": 16}, tensors) == ""
    assert "r=4" in lora_config_misfit({"r": 4, "lora_alpha": 8}, tensors)  # scale alpha/r would be wrong
    assert "lora_alpha" in lora_config_misfit({"r": 8, "lora_alpha": -1e30}, tensors)
    assert "lora_alpha" in lora_config_misfit({"r": 8, "lora_alpha": float("nan")}, tensors)
    assert lora_config_misfit({"r": 4, "rank_pattern": {"q_proj": 8}, "lora_alpha": 8}, tensors) == ""


def test_a_deeply_nested_adapter_config_is_refused_before_it_reaches_the_workers():
    from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
    from rlserve.server.convert_lifecycle import start_lora_update

    nested: object = 1
    for _ in range(500):
        nested = [nested]
    request = lpb.StartLoraUpdateRequest(
        lora_name="a", version="v", adapter_config_json=json.dumps({"r": 8, "x": nested}).encode()
    )
    with pytest.raises(InvalidRequest, match="nested deeper"):
        start_lora_update(request)
    ok = lpb.StartLoraUpdateRequest(
        lora_name="a", version="v", adapter_config_json=b'{"r": 8, "target_modules": ["q_proj"], "rank_pattern": {}}'
    )
    assert start_lora_update(ok)[2]["r"] == 8


def test_the_sdk_refuses_tensors_it_cannot_send():
    from rlserve.sdk.weight_sync import plan_sync

    with pytest.raises(ValueError, match="can be sent"):
        plan_sync({"x": torch.zeros(4, dtype=torch.int64)})


def _stream(tensors: dict, metadata=None, items=None):
    from rlserve.sdk.plan import TensorStream

    announced = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
    return TensorStream(announced if metadata is None else metadata, iter(tensors.items()) if items is None else items)


def test_a_streamed_payload_sends_what_a_planned_one_does_holding_one_chunk_at_a_time():
    from rlserve.sdk.plan import plan, plan_sync

    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(64, 16, generator=g) for i in range(6)}  # 4 KiB each
    taken: list[str] = []

    def lazily():
        for n, t in tensors.items():
            taken.append(n)
            yield n, t

    streamed = plan(_stream(tensors, items=lazily()), torch.bfloat16, chunk_bytes=4096, bucket_bytes=1024)
    planned_tensors, planned = plan_sync(tensors, torch.bfloat16, chunk_bytes=4096, bucket_bytes=1024)
    assert [c.num_bytes for c in streamed.layout] == [c.num_bytes for c in planned] == [4096] * 3
    assert all(t.checksum == "" for c in streamed.layout for t in c.tensors)  # not yet seen
    assert taken == []
    for k, (chunk, held) in enumerate(streamed.chunks()):
        assert chunk == planned[k]  # names, dtypes, shapes and digests as if planned whole
        assert sorted(held) == [t.name for t in chunk.tensors]  # this chunk's tensors only
        assert len(taken) == 2 * (k + 1)  # pulled from the stream as the chunk's turn came
        assert all(torch.equal(held[n], planned_tensors[n]) for n in held)
    with pytest.raises(RuntimeError, match="once"):
        next(streamed.chunks())


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda md, it: (md[::-1], it), "yielded 'a' where 'b'"),
        (lambda md, it: (md, iter(list(it)[:1])), "ended before 'b'"),
        (lambda md, it: (md[:1], it), "after the 1 tensors announced"),
        (lambda md, it: ([("a", "float32", [5]), md[1]], it), r"announced as float32 \[5\]"),
        (lambda md, it: (md, iter([("a", torch.zeros(4, dtype=torch.int64)), ("b", torch.zeros(4))])), "int64"),
    ],
)
def test_a_stream_that_is_not_what_it_announced_is_refused_before_its_chunk(change, match):
    from rlserve.sdk.plan import plan

    tensors = {"a": torch.zeros(4), "b": torch.ones(4)}
    md = [(n, "float32", [4]) for n in tensors]
    metadata, items = change(md, iter(tensors.items()))
    with pytest.raises(ValueError, match=match):
        for _ in plan(_stream(tensors, metadata, items), torch.float32, chunk_bytes=16, bucket_bytes=16).chunks():
            pass


@pytest.mark.parametrize(
    "metadata,match",
    [
        ([], "no tensors"),
        ([("a", "complex64", [4])], "unknown dtype|can be sent"),
        ([("a", "int64", [4])], "can be sent"),
        ([("a", "float32", [-1])], "non-negative"),
        ([("", "float32", [1])], "needs a name"),
        ([("a", "nonsense", [1])], "unknown dtype"),
        ([("a", "float32", [1 << 20, 1 << 20, 1 << 20])], "at most"),  # 4 EiB: sized nothing yet
        ([("a", "float32", [True])], "non-negative integers"),
    ],
)
def test_an_announcement_that_cannot_be_sent_is_refused_before_anything_is_taken(metadata, match):
    from rlserve.sdk.plan import TensorStream, plan

    def never():
        raise AssertionError("nothing may be taken from the stream")
        yield

    with pytest.raises(ValueError, match=match):
        plan(TensorStream(metadata, never()), torch.float32)


def test_a_stream_is_not_planned_whole_nor_patched():
    from rlserve.sdk.plan import plan_sync

    with pytest.raises(ValueError, match="not planned whole, nor patched"):
        plan_sync(_stream({"a": torch.zeros(4)}))
