"""LoRA adapters pushed in memory over rlserve_shm: the same tests as over rlserve_gloo
(`test_lora.py`), against an engine started with rlserve_shm, so the claim that both
transports share the worker code that stages, checks and writes adapters is checked."""

from __future__ import annotations

from dataclasses import replace

import pytest_asyncio

from rlserve.config import ServeConfig

from helpers import serving
from test_lora import (  # noqa: F401  (collected here, with this module's fixtures)
    test_a_bad_push_is_refused_before_any_byte_moves,
    test_an_adapter_pushed_in_memory_serves_what_vllm_serves_from_disk,
)

BACKEND = "rlserve_shm"


@pytest_asyncio.fixture(scope="module")
async def lora_engine(engines):
    async with engines.own(enable_lora=True, max_loras=2, max_lora_rank=8, weight_transfer_backend=BACKEND) as adapter:
        yield adapter


@pytest_asyncio.fixture
async def s(lora_engine, engine_config):
    config = ServeConfig(engine=replace(engine_config, weight_transfer_backend=BACKEND), transfer_timeout_s=20)
    async with serving(lora_engine, config) as stubs:
        yield stubs
