"""Reliability under mixed load and injected faults: N minutes against a real `rlserve serve
--frontends 2` (rlserve_gloo), with streams, unary calls, pauses of every mode, weight syncs,
relabels and LoRA pushes (with --lora) running at once, and faults injected at random, bounded
times: SIGKILL of the follower frontend, a trainer SIGKILLed in the middle of a sync, a client
that stops reading, and malformed requests.

Every request must end with a terminal answer (a final message, or a status): one that does
not, within a generous client deadline, is lost. INTERNAL is a bug. Every fault must be
survived: the server serves again (the follower back, the trainer's session gone, the old
weights intact). Prints one JSON line:

    .venv/bin/python benchmarks/chaos.py --minutes 5

It is a measurement, not a test: it reports what happened, and exits 1 when anything was lost,
answered INTERNAL or not survived.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from _common import free_port, make_bench_model, server, tail, until_ready

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.sdk.client import generate_request

# A request that has not ended by then is lost (the longest ones take a few seconds here).
CLIENT_DEADLINE_S = 180.0
PAUSES = (cpb.PAUSE_MODE_ABORT, cpb.PAUSE_MODE_WAIT, cpb.PAUSE_MODE_KEEP)
# How long each fault may take to be survived.
SURVIVE_S = 90.0


@dataclass
class Tally:
    sent: int = 0
    terminal: int = 0
    lost: int = 0
    internal: int = 0
    codes: Counter = field(default_factory=Counter)
    syncs_attempted: int = 0
    syncs_landed: int = 0
    syncs_rolled_back: int = 0
    faults: Counter = field(default_factory=Counter)
    survived: Counter = field(default_factory=Counter)
    not_survived: list = field(default_factory=list)
    internal_details: list = field(default_factory=list)

    def answer(self, code: grpc.StatusCode, details: str = "") -> None:
        self.codes[code.name] += 1
        if code is grpc.StatusCode.INTERNAL or code is grpc.StatusCode.UNKNOWN:
            self.internal += 1
            self.internal_details.append(details[:300])


class Chaos:
    def __init__(self, args: argparse.Namespace, target: str, control: str, proc) -> None:
        self.args, self.target, self.control_target, self.proc = args, target, control, proc
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.stop = asyncio.Event()
        self.control_channel = grpc.aio.insecure_channel(control)
        self.control = control_pb2_grpc.ControlStub(self.control_channel)
        self.lifecycle = lifecycle_pb2_grpc.LifecycleStub(self.control_channel)
        self.sync_lock = asyncio.Lock()  # one trainer at a time, as in a real loop
        self.version = 0

    # -- load -----------------------------------------------------------------------------

    def channel(self) -> grpc.aio.Channel:
        # A connection of its own, so the kernel spreads them over the frontends.
        return grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])

    async def request(self, stream: bool) -> None:
        """One generation request, counted until it ends one way or another."""
        self.tally.sent += 1
        tokens = self.rng.choice((4, 16, 64, 200))
        request = generate_request(f"chaos {self.rng.random()}", max_new_tokens=tokens, ignore_eos=True)
        async with self.channel() as ch:
            inference = inference_pb2_grpc.InferenceStub(ch)
            try:
                if stream:
                    final = None
                    async for message in inference.GenerateStream(request, timeout=CLIENT_DEADLINE_S):
                        if message.outputs.HasField("finish_info"):
                            final = message
                    if final is None:  # ended OK without its final message
                        self.tally.lost += 1
                        return
                else:
                    await inference.Generate(request, timeout=CLIENT_DEADLINE_S)
                self.tally.terminal += 1
                self.tally.answer(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.tally.lost += 1  # no answer within the client's deadline
                else:
                    self.tally.terminal += 1
                self.tally.answer(e.code(), e.details() or "")

    async def load(self) -> None:
        """About `--concurrency` requests in flight at all times, streams and unary mixed."""
        running: set[asyncio.Task] = set()
        while not self.stop.is_set():
            while len(running) < self.args.concurrency:
                task = asyncio.ensure_future(self.request(stream=self.rng.random() < 0.7))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.05)
        await asyncio.gather(*running)

    # -- the control plane ----------------------------------------------------------------

    async def checked(self, call) -> grpc.StatusCode:
        try:
            await call
            self.tally.answer(grpc.StatusCode.OK)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            self.tally.answer(e.code(), e.details() or "")
            return e.code()

    async def controller(self) -> None:
        """Pauses of every mode (resumed after a moment), relabels and syncs, at random."""
        while not self.stop.is_set():
            await asyncio.sleep(self.rng.uniform(1.0, 4.0))
            action = self.rng.choice(("pause", "pause", "relabel", "sync", "sync"))
            if action == "pause":
                mode = self.rng.choice(PAUSES)
                await self.checked(self.control.PauseGeneration(cpb.PauseGenerationRequest(mode=mode), timeout=120))
                await asyncio.sleep(self.rng.uniform(0.05, 1.0))
                await self.checked(self.control.ResumeGeneration(cpb.ResumeGenerationRequest(), timeout=30))
            elif action == "relabel":
                request = lpb.UpdateWeightVersionRequest(weight_version=f"label-{self.rng.randrange(1 << 30)}")
                await self.checked(self.lifecycle.UpdateWeightVersion(request, timeout=30))
            else:
                await self.sync()

    async def sync(self, die_after_s: float | None = None) -> int:
        """A trainer process syncing perturbed weights; SIGKILLed after `die_after_s` when set.
        Returns its exit status."""
        async with self.sync_lock:
            self.version += 1
            self.tally.syncs_attempted += 1
            trainer = await asyncio.create_subprocess_exec(
                sys.executable, "-c", TRAINER, self.control_target, self.args.model, f"chaos-{self.version}",
                str(self.rng.randrange(1 << 30)), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            if die_after_s is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(trainer.stdout.readline(), 60)  # "syncing": it has the weights ready
                await asyncio.sleep(die_after_s)
                with contextlib.suppress(ProcessLookupError):
                    trainer.kill()
            out, err = await trainer.communicate()
            if trainer.returncode == 0 and b"landed" in out:
                self.tally.syncs_landed += 1
            else:
                self.tally.syncs_rolled_back += 1
                if die_after_s is None:
                    print(f"[chaos] a sync failed: {err.decode()[-500:]}", file=sys.stderr)
            return trainer.returncode

    # -- faults ---------------------------------------------------------------------------

    async def faults(self) -> None:
        kinds = ("kill_follower", "kill_trainer", "stalled_reader", "malformed")
        while not self.stop.is_set():
            await asyncio.sleep(self.rng.uniform(self.args.fault_every_s / 2, self.args.fault_every_s * 1.5))
            if self.stop.is_set():
                return
            kind = self.rng.choice(kinds)
            self.tally.faults[kind] += 1
            try:
                await asyncio.wait_for(getattr(self, kind)(), SURVIVE_S)
                await asyncio.wait_for(self.serving_again(), SURVIVE_S)
                self.tally.survived[kind] += 1
            except Exception as e:  # noqa: BLE001 - a fault not survived is the finding
                self.tally.not_survived.append(f"{kind}: {type(e).__name__}: {e}"[:300])

    async def state(self) -> lpb.LifecycleState:
        return await self.lifecycle.GetState(lpb.GetStateRequest(), timeout=30)

    async def kill_follower(self) -> None:
        """SIGKILL frontend 1; survived once a new process serves in its place."""
        before = [f for f in (await self.state()).frontends if f.index == 1]
        if not before:
            raise RuntimeError("frontend 1 was not serving when the fault came")
        os.kill(before[0].pid, signal.SIGKILL)
        while True:
            now = [f for f in (await self.state()).frontends if f.index == 1]
            if now and now[0].pid != before[0].pid:
                return
            await asyncio.sleep(0.2)

    async def kill_trainer(self) -> None:
        """A trainer SIGKILLed at a random moment of its sync; survived once its session is
        gone (the lease), generation runs, and the weights are consistent."""
        await self.sync(die_after_s=self.rng.uniform(0.0, 0.5))
        while True:
            state = await self.state()
            if not state.HasField("update_session") and state.pause_phase == lpb.PAUSE_PHASE_RUNNING:
                if not state.weights_consistent:
                    raise RuntimeError(f"weights inconsistent after a killed trainer: {state.inconsistency_reason}")
                return
            await asyncio.sleep(0.2)

    async def stalled_reader(self) -> None:
        """A stream whose client stops reading for a while, then goes away."""
        self.tally.sent += 1
        async with self.channel() as ch:
            call = inference_pb2_grpc.InferenceStub(ch).GenerateStream(
                generate_request("never read", max_new_tokens=400, ignore_eos=True), timeout=CLIENT_DEADLINE_S
            )
            await call.read()
            await asyncio.sleep(self.rng.uniform(2.0, 10.0))
            call.cancel()
        self.tally.terminal += 1  # the client ended it
        self.tally.codes["CANCELLED"] += 1

    async def malformed(self) -> None:
        """Bytes that are no valid request, to Generate and to control calls."""
        async with self.channel() as ch:
            for method in ("/vllm.Inference/Generate", "/vllm.Control/GetServerInfo"):
                call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
                try:
                    await call(bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 64))), timeout=30)
                    self.tally.answer(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    self.tally.answer(e.code(), e.details() or "")

    async def serving_again(self) -> None:
        """A short request through a fresh connection answers, both frontends serve."""
        while True:
            state = await self.state()
            if len(state.frontends) == 2 and state.pause_phase == lpb.PAUSE_PHASE_RUNNING:
                async with self.channel() as ch:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await inference_pb2_grpc.InferenceStub(ch).Generate(
                            generate_request("alive?", max_new_tokens=2), timeout=30
                        )
                        return
            await asyncio.sleep(0.5)

    async def run(self) -> dict:
        start = resources(self.proc.pid)
        tasks = [asyncio.ensure_future(t) for t in (self.load(), self.controller(), self.faults())]
        await asyncio.sleep(self.args.minutes * 60)
        self.stop.set()
        await asyncio.gather(*tasks)
        await self.checked(self.control.ResumeGeneration(cpb.ResumeGenerationRequest(), timeout=30))
        await asyncio.wait_for(self.serving_again(), SURVIVE_S)
        end = resources(self.proc.pid)
        await self.control_channel.close()
        t = self.tally
        return {
            "benchmark": "chaos",
            "minutes": self.args.minutes,
            "seed": self.args.seed,
            "requests": {"sent": t.sent, "terminal": t.terminal, "lost": t.lost},
            "answers": dict(sorted(t.codes.items())),
            "internal": t.internal,
            "syncs": {"attempted": t.syncs_attempted, "landed": t.syncs_landed, "rolled_back": t.syncs_rolled_back},
            "faults": {"injected": dict(t.faults), "survived": dict(t.survived), "not_survived": t.not_survived},
            "server": {"start": start, "end": end},
            "internal_details": t.internal_details[:10],
        }


def resources(pid: int) -> dict:
    """Resident memory and open fds of the server's processes (frontends, engine, helpers),
    and the processes by title."""
    root = psutil.Process(pid)
    rss, fds, titles = 0, 0, Counter()
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            titles[proc.name()] += 1
    return {"rss_mb": round(rss / 2**20, 1), "fds": fds, "processes": dict(sorted(titles.items()))}


# The trainer: the SDK in a process of its own, perturbed weights synced once ("landed").
TRAINER = """
import sys, torch
from safetensors.torch import load_file
from pathlib import Path
from rlserve.sdk.client import Client
from rlserve.sdk.weight_sync import WeightSync
target, model, version, seed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
weights = {}
for f in sorted(model.glob("*.safetensors")):
    weights.update(load_file(f))
g = torch.Generator().manual_seed(seed)
weights = {n: t + 1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in weights.items()}
with Client(target) as client:
    sync = WeightSync(client, timeout_s=20, chunk_bytes=1 << 20, bucket_bytes=1 << 20)
    print("syncing", flush=True)
    try:
        sync.sync(weights, version)
    finally:
        sync.close()
print("landed", flush=True)
"""


async def main(args: argparse.Namespace) -> int:
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if not args.model:
        args.model = str(make_bench_model(work_dir / "models" / "llama-h256-l4"))
    port, control = free_port(), f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "rlserve", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--frontends", "2", "--control-address", control, "--weight-transfer-backend", "rlserve_gloo"]
    cmd += ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--kv-cache-gib", "1"]
    cmd += ["--update-lease-s", "5", "--transfer-timeout-s", "20", "--max-frontend-restarts", "100"]
    log = work_dir / "chaos-server.log"
    async with server(cmd, log) as proc:
        from rlserve.sdk.client import AsyncClient

        async def ready() -> None:
            async with AsyncClient(control) as client:
                await client.wait_ready(timeout_s=600)

        await until_ready(ready(), proc, log)
        result = await Chaos(args, f"127.0.0.1:{port}", control, proc).run()
    print(json.dumps(result))
    bad = result["requests"]["lost"] or result["internal"] or result["faults"]["not_survived"]
    if bad:
        print(f"[chaos] server log tail:\n{tail(log)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16, help="generation requests in flight")
    parser.add_argument("--fault-every-s", type=float, default=20.0, help="mean seconds between faults")
    parser.add_argument("--model", default="", help="HF model directory (default: a 16M random Llama)")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "rlserve-bench"))
    sys.exit(asyncio.run(main(parser.parse_args())))
