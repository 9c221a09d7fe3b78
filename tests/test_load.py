"""Load with the lifecycle churning underneath: 64 concurrent generation streams while a real
trainer process runs 20 cycles of pause -> weight sync -> resume and another client relabels
the version in between. Every stream ends with exactly one terminal message, none is lost or
duplicated, token counts and version spans add up, and the state is consistent at the end."""

from __future__ import annotations

import asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb

from helpers import gloo_config, long_request, perturbed, run_trainer_syncs, save_weights, serving

NUM_STREAMS = 64
NUM_SYNCS = 20
TOKENS = 24


async def test_64_streams_through_20_syncs_lose_nothing(wt_engine, engine_config, tiny_model_dir, tmp_path):
    config = gloo_config(engine_config, transfer_timeout_s=20)
    a = save_weights(perturbed(tiny_model_dir, seed=11), tmp_path / "a.safetensors")
    b = save_weights(perturbed(tiny_model_dir, seed=12), tmp_path / "b.safetensors")
    async with serving(wt_engine, config) as s:
        trainer_done = asyncio.Event()
        sent, finals, problems = [0], [], []

        async def client(slot: int) -> None:
            while not trainer_done.is_set():
                sent[0] += 1
                terminal, tokens, chunks = 0, 0, []
                async for r in s.inference.GenerateStream(long_request(f"load {slot}", max_new_tokens=TOKENS)):
                    chunks.append(r)
                    tokens += r.outputs.num_tokens
                    terminal += r.outputs.HasField("finish_info")
                last = chunks[-1].outputs
                spans = [(x.weight_version, x.start, x.end) for x in last.weight_version_spans]
                if terminal != 1 or last.finish_info.num_output_tokens != tokens or tokens != TOKENS:
                    problems.append(("count", slot, terminal, tokens))
                if spans[0][1] != 0 or spans[-1][2] != tokens or any(p[2] != q[1] for p, q in zip(spans, spans[1:])):
                    problems.append(("spans", slot, spans))
                finals.append(spans)

        async def relabel() -> None:
            i = 0
            while not trainer_done.is_set():
                i += 1
                await s.control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=f"relabel-{i}"))
                await asyncio.sleep(0.2)  # between the trainer's syncs, at its own pace

        async def train() -> tuple[int, list[dict], str]:
            try:
                return await run_trainer_syncs(
                    s.target,
                    a,
                    "load",
                    "--repeat",
                    str(NUM_SYNCS),
                    "--other-weights",
                    str(b),
                    "--timeout-s",
                    "20",
                    timeout_s=600,
                )
            finally:
                trainer_done.set()

        tasks = [asyncio.ensure_future(client(i)) for i in range(NUM_STREAMS)]
        relabeler = asyncio.ensure_future(relabel())
        rc, syncs, err = await train()
        await asyncio.wait_for(asyncio.gather(*tasks, relabeler), 120)
        assert rc == 0, err
        assert [x["weight_version"] for x in syncs] == [f"load-{i}" for i in range(NUM_SYNCS)]
        assert not problems, problems[:5]
        assert len(finals) == sent[0], "every request sent ended with a terminal message"
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        assert state.pause_phase == lpb.PAUSE_PHASE_RUNNING and state.weights_consistent
        assert not state.HasField("update_session") and state.num_held_requests == 0
        assert all(e.weight_version == state.weight_version and not e.paused for e in state.engines)
        versions = {v for spans in finals for v, _, _ in spans}
        assert any(v.startswith("load-") for v in versions) and any(len(spans) > 1 for spans in finals)
        print(
            f"load: {sent[0]} requests sent, {len(finals)} completed, {sent[0] - len(finals)} lost; "
            f"{sum(len(f) > 1 for f in finals)} spanned a version change"
        )
