"""Hugging Face TRL trains through rlserve (`rlserve.integrations.trl`): the real
`GRPOTrainer` of the `rlserve[trl]` release, on the CPU, with a tiny random model and its real
tokenizer, generating and syncing through a real rlserve server over rlserve_gloo and
rlserve_shm. What the trainer logs (its sampling-vs-training logprob gap, its importance
sampling ratio) is read from its own log history; what is served, from the server."""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import replace

import grpc
import pytest
import pytest_asyncio
import torch
import trl  # make test installs the rlserve[trl] extra: a failure, not a skip

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.config import ServeConfig
from rlserve.integrations import trl as rlserve_trl
from rlserve.sdk.weight_sync import WeightSyncError
from rlserve.wire.protocol import tensor_checksum

from helpers import eventually, serving, sync_checkpoint

pytestmark = pytest.mark.engine
TIMEOUT_S = 30.0
PROMPTS = ["Count to five:", "Name a colour:", "The sky is", "Two plus two is"]


async def _server(engine, engine_config, **engine_fields):
    config = ServeConfig(engine=replace(engine_config, **engine_fields), transfer_timeout_s=TIMEOUT_S)
    return serving(engine, config)


@pytest_asyncio.fixture(scope="module", params=["rlserve_gloo", "rlserve_shm"])
async def server(request, engines, engine_config, tiny_model_dir):
    """A server over each transport that also runs on the CPU."""
    engine = await engines.get(weight_transfer_backend=request.param)
    async with await _server(engine, engine_config, weight_transfer_backend=request.param) as s:
        await sync_checkpoint(s.target, tiny_model_dir)
        yield s


@pytest_asyncio.fixture(scope="module")
async def processed(engines, engine_config, tiny_model_dir):
    """vLLM's processed logprobs (after temperature), as TRL asks for (test_logprobs_mode
    shares the engine)."""
    fields = {"logprobs_mode": "processed_logprobs", "weight_transfer_backend": "rlserve_gloo"}
    engine = await engines.get(**fields)
    async with await _server(engine, engine_config, **fields) as s:
        await sync_checkpoint(s.target, tiny_model_dir)
        yield s


def _length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c)) / 16.0 for c in completions]


def _trainer(model_dir, target: str, tmp_path, *, temperature: float = 1.0, steps: int = 3, reward=_length_reward):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=5e-3,
        temperature=temperature,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=7,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=f"grpc://{target}",
        vllm_server_timeout=30.0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    data = Dataset.from_dict({"prompt": PROMPTS * 4})
    return trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer
    )


def _recording(trainer) -> list[tuple[str, list[list[str]]]]:
    """Per generation: the version of the last sync before it and every completion's
    per-token versions, as the server reported them."""
    client = trainer.vllm_generation.vllm_client
    seen: list[tuple[str, list[list[str]]]] = []
    generate = client.generate

    def recorded(*args, **kwargs):
        out = generate(*args, **kwargs)
        seen.append((str(client.step - 1), out["weight_versions"]))
        return out

    client.generate = recorded
    return seen


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


async def _served(s) -> dict[str, str]:
    return dict((await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor)


async def test_grpo_trains_three_steps_through_rlserve(server, tiny_model_dir, tmp_path):
    """Three GRPO steps: the server ends on the last step's version and serves the trainer's
    parameters, every token was sampled by the version synced just before it (staleness 0),
    TRL's sampling-vs-training gap stays within fp32 noise, and the parameters moved."""
    s = server
    with rlserve_trl.install():
        # In a thread: the server answers on this test's event loop.
        trainer = await asyncio.to_thread(_trainer, tiny_model_dir, s.target, tmp_path)
        seen = _recording(trainer)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        await asyncio.to_thread(trainer.train)
        client = trainer.vllm_generation.vllm_client
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == "2" and state.weights_consistent
    assert [st.weight_version for st in client.sync_stats] == ["0", "1", "2"]
    assert all(st.num_chunks >= 1 and st.checksum for st in client.sync_stats)
    params = dict(trainer.model.named_parameters())
    assert len(seen) == 3
    for synced, versions in seen:
        assert versions and all(v == synced for per_token in versions for v in per_token)
    gaps = _logged(trainer, "sampling/sampling_logp_difference/max")
    assert len(gaps) == 3 and max(gaps) <= 1e-3, gaps
    assert any(not torch.equal(before[n], p) for n, p in params.items())
    # The last step trained after its sync: one more push, and the server serves exactly the
    # trainer's parameters (the sync verified it too, from the served model).
    await asyncio.to_thread(client.update_model_params, trainer.model)
    served = await _served(s)
    assert {n: served[n] for n in params} == {n: tensor_checksum(p) for n, p in params.items()}
    await asyncio.to_thread(client.close)


async def test_processed_logprobs_keep_trls_importance_ratio_at_one_and_raw_ones_do_not(
    processed, wt_engine, engine_config, tiny_model_dir, tmp_path
):
    """At temperature 0.7 TRL corrects with exp(training logprob - sampling logprob): with
    `--logprobs-mode processed_logprobs` the two agree (ratio 1), with vLLM's raw logprobs
    (before temperature, rlserve's default) the ratio is visibly off: why the mode matters."""

    async def ratios(s, name: str) -> tuple[float, float]:
        with rlserve_trl.install():
            trainer = await asyncio.to_thread(
                _trainer, tiny_model_dir, s.target, tmp_path / name, temperature=0.7, steps=2
            )
            client = trainer.vllm_generation.vllm_client
            info = await asyncio.to_thread(client.get_server_info)
            assert info["model_config"]["logprobs_mode"] == name + "_logprobs"
            await asyncio.to_thread(trainer.train)
            await asyncio.to_thread(client.close)
        lo = _logged(trainer, "sampling/importance_sampling_ratio/min")
        hi = _logged(trainer, "sampling/importance_sampling_ratio/max")
        assert len(lo) == len(hi) == 2
        return min(lo), max(hi)

    processed_lo, processed_hi = await ratios(processed, "processed")
    async with await _server(wt_engine, engine_config, weight_transfer_backend="rlserve_gloo") as raw:
        await sync_checkpoint(raw.target, tiny_model_dir)
        raw_lo, raw_hi = await ratios(raw, "raw")
    assert 1 - 1e-3 <= processed_lo and processed_hi <= 1 + 1e-3, (processed_lo, processed_hi)
    assert raw_lo < 0.9 or raw_hi > 1.1, (raw_lo, raw_hi)


async def test_a_sync_the_server_refuses_raises_in_the_trainer_and_the_old_weights_serve(
    server, tiny_model_dir, tmp_path
):
    """A parameter of a shape the served model does not have: the first sync is refused, TRL's
    train() raises at once with the server's reason, and the server serves what it did."""
    before = await _served(server)
    with rlserve_trl.install():
        trainer = await asyncio.to_thread(_trainer, tiny_model_dir, server.target, tmp_path)
        norm = trainer.model.model.norm
        norm.weight = torch.nn.Parameter(torch.ones(norm.weight.shape[0] // 2))
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="old weights kept") as e:
            await asyncio.to_thread(trainer.train)
        await asyncio.to_thread(trainer.vllm_generation.vllm_client.close)
    assert time.monotonic() - t0 < TIMEOUT_S and e.value.resumed_on_old_weights
    state = await server.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == "checkpoint" or state.weight_version.isdigit()
    assert state.pause_phase == lpb.PAUSE_PHASE_RUNNING and not state.HasField("update_session")
    assert await _served(server) == before


async def test_a_server_that_goes_away_mid_step_ends_training_with_a_clear_error(
    wt_engine, engine_config, tiny_model_dir, tmp_path
):
    """The server stops while the trainer scores the first step's completions: the next call
    (the second step's sync) fails at once with UNAVAILABLE, not at some distant deadline."""
    async with await _server(wt_engine, engine_config, weight_transfer_backend="rlserve_gloo") as s:
        loop = asyncio.get_running_loop()
        calls = []

        def reward_then_stop(completions, **kwargs):
            calls.append(len(completions))
            if len(calls) == 1:
                asyncio.run_coroutine_threadsafe(s.server.stop(0), loop).result(timeout=TIMEOUT_S)
            return _length_reward(completions)

        with rlserve_trl.install():
            trainer = await asyncio.to_thread(_trainer, tiny_model_dir, s.target, tmp_path, reward=reward_then_stop)
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as e:
                await asyncio.to_thread(trainer.train)
            elapsed = time.monotonic() - t0
    assert len(calls) == 1 and elapsed < TIMEOUT_S
    assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value


def test_the_adapter_answers_every_public_method_of_trls_client():
    """A TRL release whose client grows a method the adapter lacks fails here (and the
    extra pins the release that was compared)."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from trl.generation.vllm_client import VLLMClient

    public = {n for n, _ in inspect.getmembers(VLLMClient, inspect.isfunction) if not n.startswith("_")}
    missing = sorted(public - set(dir(rlserve_trl.RlserveVLLMClient)))
    assert missing == []
    for name in public - {"generate"}:
        theirs = inspect.signature(getattr(VLLMClient, name)).parameters
        ours = inspect.signature(getattr(rlserve_trl.RlserveVLLMClient, name)).parameters
        assert [p for p in theirs if p not in ours and theirs[p].default is inspect.Parameter.empty] == [], name
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["trl"] == [f"trl=={version('trl')}"]


def test_install_replaces_trls_client_where_its_trainers_look_and_uninstall_puts_it_back():
    import trl.generation.vllm_client as client_module
    import trl.generation.vllm_generation as generation

    original = generation.VLLMClient
    with rlserve_trl.install(transport="shm") as client:
        assert generation.VLLMClient is client is client_module.VLLMClient
        assert issubclass(client, rlserve_trl.RlserveVLLMClient) and client.options.transport == "shm"
        again = rlserve_trl.install()  # installing again replaces the options
        assert generation.VLLMClient is again.client and again.client.options.transport == "auto"
    assert generation.VLLMClient is original is client_module.VLLMClient
    rlserve_trl.uninstall()  # nothing installed: nothing to do
    with pytest.raises(TypeError):
        rlserve_trl.install(no_such_option=1)
    assert generation.VLLMClient is original


@pytest.mark.parametrize(
    "url,target",
    [
        ("grpc://127.0.0.1:50051", "127.0.0.1:50051"),
        ("http://10.0.0.2:7000", "10.0.0.2:7000"),
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("grpc://[::1]:5000", "[::1]:5000"),
    ],
)
def test_trls_server_url_names_the_grpc_target(url, target):
    assert rlserve_trl.target_of(url, "0.0.0.0", 8000) == target
    assert rlserve_trl.target_of(None, "h", 1) == "h:1"


@pytest.mark.parametrize("url", ["grpc://127.0.0.1", "grpc://:5000", "nonsense"])
def test_a_server_url_without_host_and_port_is_refused(url):
    with pytest.raises(ValueError, match="host:port"):
        rlserve_trl.target_of(url, "0.0.0.0", 8000)


async def test_async_grpos_protocols_push_versions_and_buffer_rollouts_with_their_versions(server, tiny_model_dir):
    """AsyncGRPOTrainer's two protocols driven as its loop drives them: each push publishes the
    next model version (served digests = what was pushed); rollouts arrive in the buffer
    tagged with the oldest version behind their tokens, read from the server."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlserve.integrations.trl.async_grpo import RlserveRolloutWorker, RlserveWeightTransfer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    metadata = [(n, "float32", list(p.shape)) for n, p in model.named_parameters()]
    push = RlserveWeightTransfer(server.target, metadata=metadata)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    worker = RlserveRolloutWorker(server.target, prompts, [_length_reward], tokenizer, num_generations=2, max_tokens=4)

    def drive():
        push.init_weight_transfer()
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            push.pause()
            push.send_weights((n, p.detach()) for n, p in model.named_parameters())
            push.resume()
            worker.update_model_version(push.model_version)
            if version == 1:
                worker.start()
            worker.check_health(stale_after_s=TIMEOUT_S)
        # Groups sampled while the second push staged are in the buffer first: take samples
        # until one generated after it arrives (each get bounded).
        samples = []
        while not samples or samples[-1].model_version != 2:
            assert len(samples) < worker.rollout_buffer.maxsize + 64, "no sample after the second push"
            samples.append(worker.rollout_buffer.get(timeout=TIMEOUT_S))
        worker.stop()
        push.destroy()
        return samples

    samples = await asyncio.to_thread(drive)
    state = await server.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == "2" and [s.weight_version for s in push.sync_stats] == ["1", "2"]
    served = await _served(server)
    assert {n: served[n] for n, _ in model.named_parameters()} == {
        n: tensor_checksum(p.detach()) for n, p in model.named_parameters()
    }
    assert all(s.model_version in (1, 2) for s in samples) and samples[-1].model_version == 2
    for s in samples:
        assert len(s.input_ids) == len(s.completion_mask) == len(s.old_log_probs)
        assert s.completion_mask.sum() >= 1 and (s.old_log_probs[s.completion_mask == 1] <= 0).all()


async def test_the_demo_trains_with_trls_grpo_trainer_through_a_running_server(processed, tiny_model_dir, tmp_path):
    """`rlserve demo --trainer trl --server ...` as a user runs it: TRL's loop, two steps, a
    line and a JSON record per step, the server on the last step's version."""
    import json
    import sys

    out = tmp_path / "demo"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlserve", "demo", "--trainer", "trl", "--server", processed.target,
        "--model", str(tiny_model_dir), "--steps", "2", "--prompts-per-step", "1", "--group-size", "4",
        "--max-new-tokens", "4", "--out", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    text = output.decode()
    assert proc.returncode == 0, text[-3000:]
    records = [json.loads(line) for line in (out / "trl-steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("reward" in r for r in records)
    assert "step 2: reward" in text and "serves version 1" in text
    state = await processed.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == "1"
    await sync_checkpoint(processed.target, tiny_model_dir)


async def test_the_demo_refuses_what_trls_loop_cannot_do(tmp_path):
    import sys

    for extra in (["--server", "a:1", "--server", "b:2"], ["--async"], ["--group-size", "1"]):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rlserve", "demo", "--trainer", "trl", "--out", str(tmp_path), *extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode == 2 and b"rlserve demo --trainer trl:" in output, output[-500:]


async def test_a_prompt_the_server_refuses_fails_generate_and_ends_every_other_request(server):
    """One prompt of a batch is refused (a token id past the vocabulary): generate raises the
    server's INVALID_ARGUMENT, and the batch's other requests, long ones, are cancelled on the
    server at once, not left running; the next generate works."""
    with rlserve_trl.install() as adapter:
        client = await asyncio.to_thread(adapter, f"grpc://{server.target}")
        long_ones = [[17, 42, 256]] * 3
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.to_thread(
                client.generate, [*long_ones, [10**9]], n=2, max_tokens=500, generation_kwargs={"ignore_eos": True}
            )
        refused_after_s = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        async def none_outstanding() -> bool:
            return (await server.lifecycle.GetLoad(lpb.GetLoadRequest())).num_outstanding_requests == 0

        # 3 x 2 sequences of 500 tokens take the tiny model seconds on two cores.
        await eventually(none_outstanding, timeout_s=1.5)
        again = await asyncio.to_thread(client.generate, long_ones[:1], n=2, max_tokens=4)
        assert [len(c) for c in again["completion_ids"]] == [4, 4]
        # Nothing of the failed batch started late either, on the client's next call.
        assert await none_outstanding()
        t0 = time.monotonic()
        await asyncio.to_thread(client.generate, long_ones, n=2, max_tokens=500, generation_kwargs={"ignore_eos": True})
        # The refusal came at once, not after the batch's other requests ran to their end.
        print(f"refused after {refused_after_s:.2f} s; the batch takes {time.monotonic() - t0:.2f} s")
        assert refused_after_s < (time.monotonic() - t0) / 3
        await asyncio.to_thread(client.close)
