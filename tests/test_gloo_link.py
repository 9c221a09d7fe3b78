"""A worker's gloo helpers, without an engine: one is kept started ahead of the join that
takes it, so a rendezvous waits for the trainer's group only, not for a process to start and
import torch (2-3 s of a core on a slow CPU: more than a trainer's deadline may be)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from rlserve.sdk.senders import TensorSender
from rlserve.wire.gloo_group import GlooGroup
from rlserve.wire.protocol import ChunkInfo, InitInfo, ProtocolError, TensorMeta, WorkerError, tensor_checksum
from rlserve.worker import gloo_link
from rlserve.worker.gloo_link import EXIT_S, GlooLink, SpareHelper

# Shorter than starting a helper takes on the machines this runs on (2.2 s to import torch
# on an AVX2 EPYC), far longer than joining a group of two on one host.
RENDEZVOUS_S = 1.0


def helpers() -> set[int]:
    """The pids of this process's gloo helpers."""
    return {p.pid for p in psutil.Process().children() if "rlserve.worker.gloo_helper" in _command_line(p)}


def _command_line(process: psutil.Process) -> list[str]:
    """`process`'s command line, once it has one: a process started a moment ago shows an
    empty one for a while after `Popen` has returned (the kernel sets it up after closing the
    close-on-exec pipe that Popen waits on): 232 of 300 reads right after Popen, on two busy
    cores here, and a fresh-clone run under two pytest processes counted no helper. Empty for
    a process that has exited."""
    deadline = time.monotonic() + 5
    with contextlib.suppress(psutil.NoSuchProcess):
        while process.status() != psutil.STATUS_ZOMBIE:
            if command_line := process.cmdline():
                return command_line
            assert time.monotonic() < deadline, f"process {process.pid} shows no command line"
            time.sleep(0.01)
    return []


@pytest.fixture
def spare():
    before = helpers()
    spare = SpareHelper()
    spare.keep()
    yield spare
    spare.close()
    psutil.wait_procs([psutil.Process(pid) for pid in helpers() - before], timeout=EXIT_S + 5)


def test_a_started_helper_joins_a_trainer_whose_deadline_is_shorter_than_its_start(spare):
    link = spare.take()
    try:
        link.wait_started()  # as an idle worker's spare did, long before a trainer asks
        store = GlooGroup.host_store("127.0.0.1", 0, 2, RENDEZVOUS_S)
        info = InitInfo("127.0.0.1", store.port, 1, 2, RENDEZVOUS_S)
        joined: list[BaseException | None] = []

        def worker() -> None:
            try:
                link.join_group(info, 1)
                joined.append(None)
            except BaseException as e:
                joined.append(e)

        thread = threading.Thread(target=worker)
        thread.start()
        trainer = GlooGroup(store, 0, 2, RENDEZVOUS_S)
        thread.join()
        assert joined == [None]
        # The helper is in the group, not merely connected: its refusal reaches the trainer.
        chunk = ChunkInfo((TensorMeta("w", "float32", (4,), tensor_checksum(torch.ones(4))),))
        votes = ThreadPoolExecutor(1).submit(trainer.vote, True)
        assert link.exchange(chunk, False, RENDEZVOUS_S, lambda *_: None) is False
        assert votes.result() is False
    finally:
        link.close()


def test_a_take_gets_the_spare_started_ahead_and_the_next_starts_when_the_link_rests(spare):
    """Not as it is taken: a sync usually follows an init, and starting a helper takes a core
    for seconds."""
    (first,) = helpers()
    link = spare.take()
    try:
        assert link.alive()
        assert helpers() == {first}, "no spare starts while the new link is busy"
        link.wait_started()
        link.rest()
        link.rest()
        assert len(helpers() - {first}) == 1, "the next spare starts once the link rests, once"
    finally:
        link.close()
    spare.close()
    gone = psutil.wait_procs([psutil.Process(pid) for pid in helpers()], timeout=EXIT_S + 5)[1]
    assert not gone, "a closed link's helper and the dropped spare exit"


def joined(link: GlooLink) -> TensorSender:
    """A trainer (a TensorSender of world size 2) in a group with `link`'s helper."""
    sender = TensorSender(1, timeout_s=20.0)
    joining = ThreadPoolExecutor(1).submit(link.join_group, InitInfo(**sender.init_info()), 1)
    sender.join()
    joining.result()
    return sender


def one_chunk(link: GlooLink, sender: TensorSender, value: float) -> None:
    """A chunk of one tensor, sent and received whole."""
    tensors = {"w": torch.full((1000,), value)}
    chunk = ChunkInfo((TensorMeta("w", "float32", (1000,), tensor_checksum(tensors["w"])),))
    landed: list[torch.Tensor] = []
    sent = ThreadPoolExecutor(1).submit(sender.send, chunk, tensors)
    assert link.exchange(chunk, True, 20.0, lambda bucket, _: landed.append(bucket["w"].clone())) is True
    assert sent.result() is True and torch.equal(landed[0], tensors["w"])


def test_a_closed_links_healthy_helper_is_the_next_spare_out_of_its_group(spare):
    """A trainer that inits again and again costs the serving host no new process: the helper
    of the link a re-init closes leaves its group and is the spare the next join takes."""
    (first,) = helpers()
    link = spare.take()
    sender = joined(link)
    try:
        one_chunk(link, sender, 1.0)
    finally:
        link.close()
        link.rest()
    assert helpers() == {first}, "no helper exits and none starts"
    again = spare.take()
    try:
        assert again.out_of_its_group() and again._process.pid == first
        other = joined(again)  # a new trainer's group, a fresh landing area
        try:
            one_chunk(again, other, 2.0)
        finally:
            other.close()
        # The old trainer's group lost its member: its next chunk fails, it does not hang.
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            sender.send(
                ChunkInfo((TensorMeta("w", "float32", (4,), tensor_checksum(torch.ones(4))),)), {"w": torch.ones(4)}
            )
    finally:
        sender.close()
        again.close()


def test_a_helper_that_failed_or_is_busy_is_never_the_spare(spare):
    """A helper whose rendezvous failed exits (its group, if any, is out of step): a fresh
    spare replaces it. A link closed from another thread mid-chunk is not handed back."""
    (first,) = (psutil.Process(pid) for pid in helpers())
    link = spare.take()
    absent = TensorSender(1, timeout_s=1.0)  # its store listens; it never joins the group
    with pytest.raises(WorkerError):
        link.join_group(InitInfo(**{**absent.init_info(), "timeout_s": 0.5}), 1)
    absent.close()
    link.close()
    link.rest()
    first.wait(EXIT_S + 5)
    (second,) = (psutil.Process(pid) for pid in helpers())
    link = spare.take()
    sender = joined(link)
    try:
        chunk = ChunkInfo((TensorMeta("w", "float32", (4,), tensor_checksum(torch.ones(4))),))
        receiving = ThreadPoolExecutor(1).submit(link.exchange, chunk, True, 2.0, lambda *_: None)
        while not (link._busy or receiving.done()):
            time.sleep(0.01)
        link.close()  # as a server shutting down meets a chunk on the wire
        with pytest.raises(WorkerError):
            receiving.result()
        link.rest()
        second.wait(EXIT_S + 5)
        assert len(helpers()) == 1, "a fresh spare, not the busy one"
    finally:
        sender.close()


def test_a_spare_that_does_not_leave_its_group_in_time_is_replaced(spare, monkeypatch):
    """A handed-back helper stuck (here: stopped) before it says it left its group is killed
    and the join goes on with a fresh helper."""
    monkeypatch.setattr(gloo_link, "SPARE", spare)
    (first,) = helpers()
    link = spare.take()
    sender = joined(link)
    sender.close()
    stuck = psutil.Process(first)
    stuck.suspend()  # before it reads the request to leave
    link.close()
    try:
        trainer = TensorSender(1, timeout_s=30.0)
        try:
            joining = ThreadPoolExecutor(1).submit(GlooLink.join, InitInfo(**trainer.init_info()), 1)
            trainer.join()
            fresh = joining.result()
            assert fresh._process.pid != first
            fresh.close()
        finally:
            trainer.close()
        stuck.wait(EXIT_S + 5)
    finally:
        if stuck.is_running():
            stuck.kill()


def test_a_spare_that_died_is_replaced_by_a_fresh_helper(spare):
    (dead,) = helpers()
    psutil.Process(dead).kill()
    psutil.Process(dead).wait(10)
    link = spare.take()
    try:
        link.wait_started()
        assert link.alive()
    finally:
        link.close()


def test_without_keep_a_take_starts_one_helper_and_no_spare():
    before = helpers()
    link = SpareHelper().take()
    try:
        assert len(helpers() - before) == 1
        link.wait_started()
    finally:
        link.close()


def test_a_closed_links_helper_exits_behind_it():
    """A re-init closes the old link before telling the server it is done: the helper's exit
    (leaving its group, tearing torch down) happens behind it, and does happen (reaped). That
    close does not wait for it is not checked here: a helper of no group exits in moments."""
    link = GlooLink.start()
    link.wait_started()
    pid = next(iter(helpers()))
    link.close()
    psutil.Process(pid).wait(EXIT_S + 5)


def test_a_spare_exits_with_its_worker_killed_mid_wait():
    """The worker (here a process of the test's) is killed with its spare waiting and the
    spare's "started" line unread: the spare exits, quietly, and no helper outlives it."""
    worker = subprocess.Popen(
        [sys.executable, "-c", KEEPS_A_SPARE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        spare = psutil.Process(int(worker.stdout.readline()))
        worker.kill()
        worker.wait()
        spare.wait(EXIT_S + 5)
        assert "Traceback" not in worker.stderr.read()
    finally:
        worker.kill()


KEEPS_A_SPARE = """
import time, psutil
from rlserve.worker.gloo_link import SPARE
SPARE.keep()
time.sleep(5)  # started (2-3 s) and said so, unread
(spare,) = psutil.Process().children()
print(spare.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("messages", ["bucket", "tensor"])
def test_a_chunk_lands_bucket_by_bucket_whichever_message_layout_it_names(spare, messages):
    """The SDK's sender and a helper, in both layouts: a message per bucket (packed by the
    sender) or per tensor (sent from each tensor's memory; an empty tensor sends none). A
    tensor the chunk describes otherwise is refused by a vote of no before a byte moves, and
    the group stays in step for the next chunk."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(300, generator=g),
        "empty": torch.empty(0),
        "b": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "c": torch.randn(1000, generator=g),
    }
    metas = tuple(
        TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_checksum(t))
        for n, t in tensors.items()
    )
    chunk = ChunkInfo(metas, bucket_bytes=1500, messages=messages)  # two buckets
    link = spare.take()
    sender = joined(link)
    try:
        landed: list[dict[str, tuple[torch.Tensor, str]]] = []

        def deliver(bucket: dict[str, torch.Tensor], digests: dict[str, str]) -> None:
            landed.append({n: (t.clone(), digests[n]) for n, t in bucket.items()})

        for _ in range(2):  # the second time over the same group: still in step
            landed.clear()
            sent = ThreadPoolExecutor(1).submit(sender.send, chunk, tensors)
            assert link.exchange(chunk, True, 20.0, deliver) is True
            assert sent.result() is True
            assert [list(b) for b in landed] == [["a", "empty", "b"], ["c"]]
            for bucket in landed:
                for name, (tensor, digest) in bucket.items():
                    assert torch.equal(tensor, tensors[name]) and digest == tensor_checksum(tensors[name])
            wrong = {**tensors, "b": tensors["b"].float()}  # twice the bytes the chunk says
            refused = ThreadPoolExecutor(1).submit(sender.send, chunk, wrong)
            assert link.exchange(chunk, True, 20.0, deliver) is False
            with pytest.raises(ValueError, match="b: 140 bytes given, the chunk says 70"):
                refused.result()
            assert sender.joined
    finally:
        sender.close()
        link.close()


def test_a_chunks_message_layout_round_trips_and_an_unknown_one_is_refused():
    raw = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[4]], "checksums": ["x"]}
    assert ChunkInfo.parse(raw).messages == "bucket"  # as trainers sent chunks before the field
    per_tensor = ChunkInfo.parse({**raw, "messages": "tensor"})
    assert per_tensor.messages == "tensor" and ChunkInfo.parse(per_tensor.to_json()) == per_tensor
    for wrong in ("tensors", 1, None, ["tensor"]):
        with pytest.raises(ProtocolError, match="messages must be one of"):
            ChunkInfo.parse({**raw, "messages": wrong})
