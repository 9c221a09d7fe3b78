"""A worker's gloo membership, kept in a process of its own.

gloo aborts its whole process when a peer sends a message of the wrong size (a trainer with a
bug in its bucket plan, or a hostile one): that process must not be the vLLM worker. So each
worker starts a small helper (`python -m rlserve.worker.gloo_helper`) that joins the
trainer's group, votes and receives each chunk straight into shared memory the worker maps
(no copy; one landing area, kept and reused while chunks fit it), digests each bucket as it
lands (on another core than the worker's) and reports it at once, so the worker loads bucket
k while bucket k+1 is on the wire. The two talk over a socket pair, JSON lines. A helper that
dies or stops answering in time is a broken transport, never a dead worker.

Starting a helper (Python, then torch) takes 2-3 s of a core on a slow CPU: longer than a
trainer's rendezvous may wait, whose clock starts as it asks. So one helper is kept started
ahead (`SPARE`): the engine starts the first as it loads, each join takes the one that is
ready, and the next starts once the link is at rest (its first session over, or the link
closed), not during the sync that usually follows an init. A closed link whose helper is
healthy (never failed, idle) becomes that spare itself: it leaves its group and waits for the
next join, so a trainer that inits again and again costs no new process on the serving host.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import torch

from rlserve.parent import how_it_ended
from rlserve.wire.protocol import (
    SHM_DIR,
    ChunkInfo,
    Deliver,
    ErrorCode,
    InitInfo,
    WorkerError,
    landing_offsets,
    plan_buckets,
    wire_view,
)

# Margin for the helper's own deadlines to fire first and report what went wrong.
ANSWER_MARGIN_S = 5.0
# Starting Python and importing torch in the helper (when no spare was ready).
START_S = 60.0
# How long a closed helper may take to leave its group and exit (or, handed back as the
# spare, to say it is out of its group) before it is killed.
EXIT_S = 2.0


class SpareHelper:
    """One helper started ahead of the join that takes it (about 220 MiB of memory while it
    waits), once `keep` has asked for one. Thread-safe: a rendezvous that supersedes another
    may take one meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept = False
        self._ready: GlooLink | None = None

    def keep(self) -> None:
        """Keep a spare from now on (until `close`). It exits with the worker: its input ends."""
        with self._lock:
            self._kept = True
            self._refill()

    def take(self) -> GlooLink:
        """The spare, or a fresh helper if none is alive. The next is started by `refill`."""
        with self._lock:
            self._refill()
            ready, self._ready = self._ready, None
        assert ready is not None
        ready.spares = self
        return ready

    def give_back(self, link: GlooLink) -> bool:
        """Keep `link`'s helper as the spare, out of its group, if a spare is kept and none is
        ready; whether it was kept (if not, the caller closes the link)."""
        with self._lock:
            if not self._kept or (self._ready is not None and self._ready.alive()):
                return False
            if not link._leave():
                return False
            if self._ready is not None:
                self._ready.close()
            self._ready = link
            return True

    def refill(self) -> None:
        """Start the next spare, if one is kept and none is ready."""
        with self._lock:
            if self._kept:
                self._refill()

    def close(self) -> None:
        with self._lock:
            self._kept = False
            if self._ready is not None:
                self._ready.close()
                self._ready = None

    def _refill(self) -> None:
        """Under the lock: a live helper ready, started now if there was none."""
        if self._ready is None or not self._ready.alive():
            if self._ready is not None:
                self._ready.close()
            self._ready = GlooLink.start()


class GlooLink:
    def __init__(self, process: subprocess.Popen, sock: socket.socket) -> None:
        self._process = process
        self._sock = sock
        self._reader = sock.makefile("rb")
        self._started = False  # the helper said it has imported what it needs (or left its group)
        self._left = False  # handed back as a spare: its "started" line says it left its group
        self.spares: SpareHelper | None = None  # those it was taken from, refilled at rest
        # A helper that failed, timed out or ended is spent: never handed back. Busy: in a
        # chunk. Both under the lock: a close from another thread meets an exchange.
        self._lock = threading.Lock()
        self._spent = False
        self._busy = False
        # Where chunks land: created (and touched) when a chunk first needs more room, its
        # name removed once the helper has mapped it.
        self._landing: torch.Tensor | None = None

    @classmethod
    def start(cls) -> GlooLink:
        """A helper of no group yet. It waits for its first request, and exits when the
        worker's end of the pair closes."""
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "rlserve.worker.gloo_helper", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                # Its own process group, so a signal meant for the server is not the helper's to
                # act on; not its own session, which would put it in a new scheduler autogroup,
                # starved for tens of seconds while the engine keeps both cores busy.
                process_group=0,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(process, ours)

    @classmethod
    def join(cls, info: InitInfo, rank: int) -> GlooLink:
        """Join the trainer's group through the spare helper; raises WorkerError."""
        link = SPARE.take()
        if not link.out_of_its_group():
            link.close()
            link = SPARE.take()  # a fresh one
        try:
            link.join_group(info, rank)
        except BaseException:
            link.close()
            link.rest()
            raise
        return link

    def join_group(self, info: InitInfo, rank: int) -> None:
        """Join the trainer's group as `rank`, once the helper has started."""
        self.wait_started()
        self._ask({"op": "join", **info.to_json(), "rank": rank}, info.timeout_s)

    def wait_started(self) -> None:
        """Block until the helper has started (up to START_S); raises WorkerError."""
        if not self._started:
            self._ask(None, START_S)
            self._started = True

    def out_of_its_group(self) -> bool:
        """False for a helper handed back as the spare that did not say it left its old group
        within EXIT_S (it is killed); True for any other."""
        if not self._left:
            return True
        self._left = False
        try:
            self._ask(None, EXIT_S)
        except WorkerError:
            return False
        self._started = True
        return True

    def alive(self) -> bool:
        return self._process.poll() is None

    def exchange(
        self,
        info: ChunkInfo,
        accept: bool,
        timeout_s: float,
        deliver: Deliver,
    ) -> bool:
        """Vote (`accept`) with the trainer and, when everyone accepts, receive the chunk,
        handing each bucket to `deliver` (its tensors as views of the landing area, and their
        digests as the helper computed them from the bytes that arrived) as it lands.
        Returns whether everyone accepted. Raises WorkerError (TIMEOUT: the transport is
        broken), or what `deliver` raised once the chunk has been received to its end."""
        with self._lock:
            if self._spent:
                raise WorkerError(ErrorCode.TIMEOUT, "the transfer helper failed or its link was closed")
            self._busy = True
        try:
            return self._exchange(info, accept, timeout_s, deliver)
        finally:
            with self._lock:
                self._busy = False

    def _exchange(self, info: ChunkInfo, accept: bool, timeout_s: float, deliver: Deliver) -> bool:
        buckets = plan_buckets(info.tensors, info.bucket_bytes)
        starts, span = landing_offsets(buckets)
        landing, path = self._landing_for(max(1, span))
        deadline = time.monotonic() + timeout_s
        request = {"op": "chunk", "accept": accept, "path": path, "size": landing.numel(), "info": info.to_json()}
        try:
            reply = self._ask(request, timeout_s)
        finally:
            if path:
                os.unlink(path)  # both sides have it mapped; the name is not needed
        if not reply["go"]:
            return False
        failure: BaseException | None = None
        while not reply.get("done"):
            index = reply["bucket"]
            tensors = _views(landing, info, buckets[index], starts[index])
            if failure is None:
                try:
                    deliver(tensors, dict(zip(tensors, reply["checksums"])))
                except BaseException as e:  # the helper goes on to the chunk's end: in step
                    failure = e
            reply = self._ask(None, max(0.0, deadline - time.monotonic()))
        if failure is not None:
            raise failure
        return True

    def _landing_for(self, size: int) -> tuple[torch.Tensor, str]:
        """The landing area, grown to `size` bytes if needed, and its path if the helper has
        yet to map it."""
        if self._landing is not None and self._landing.numel() >= size:
            return self._landing, ""
        self._landing = None  # the old one is unmapped here; the helper drops it on the new path
        path = str(SHM_DIR / f"rlserve-chunk-{os.getpid()}-{uuid.uuid4().hex}")
        landing = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        landing.zero_()  # its pages exist from now on, not at the first bucket of every chunk
        self._landing = landing
        return landing, path

    def close(self) -> None:
        """The membership is over: the helper becomes the spare of those it was taken from if
        it is healthy and idle and they have none ready, and otherwise exits."""
        with self._lock:
            reusable = not (self._spent or self._busy) and self.alive()
            self._spent = True
        if reusable and self.spares is not None and self.spares.give_back(self):
            return
        try:
            self._sock.sendall(b'{"op": "close"}\n')
        except OSError:
            pass
        self._reader.close()
        self._sock.close()
        if self.alive():  # leaving its group takes it a while: the caller need not wait
            threading.Thread(target=self._reap, name="rlserve-helper-reaper", daemon=True).start()

    def rest(self) -> None:
        """Its session is over, or it was closed: start the next spare helper."""
        if self.spares is not None:
            self.spares.refill()

    def _leave(self) -> bool:
        """Ask the helper to leave its group and drop the landing area (as this side does):
        it is a spare now, whose next join reads the answer (`out_of_its_group`)."""
        try:
            self._sock.sendall(b'{"op": "leave"}\n')
        except OSError:
            return False
        self._landing = None
        self.spares = None
        self._started, self._left = False, True
        with self._lock:
            self._spent = False
        return True

    def _reap(self) -> None:
        try:
            self._process.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            self._kill()

    def misfit(self, info: ChunkInfo) -> str | None:
        # Buckets of any size go over the wire; a segment offset means nothing here.
        return "segment_offset is for rlserve_shm" if info.segment_offset else None

    def _ask(self, request: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
        """Send `request` (None: nothing, read the next line of an answer) and read a line."""
        try:
            self._sock.settimeout(timeout_s + ANSWER_MARGIN_S)
            if request is not None:
                self._sock.sendall(json.dumps(request).encode() + b"\n")
            line = self._reader.readline()
        except (OSError, TimeoutError) as e:
            self._spend()
            self._kill()
            raise WorkerError(ErrorCode.TIMEOUT, f"the transfer helper did not answer in time: {e}") from e
        if not line:
            self._spend()
            code = self._process.wait()
            raise WorkerError(
                ErrorCode.TIMEOUT,
                f"the transfer helper ended ({how_it_ended(code)}): the trainer broke the protocol or went away",
            )
        reply = json.loads(line)
        if not reply["ok"]:
            self._spend()  # the helper exits after any failure
            raise WorkerError(ErrorCode(reply["code"]), reply["message"])
        return reply

    def _spend(self) -> None:
        with self._lock:
            self._spent = True

    def _kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def _views(memory: torch.Tensor, info: ChunkInfo, bucket: Any, start: int) -> dict[str, torch.Tensor]:
    """The tensors of one bucket (at byte `start`), viewed in place in the memory it landed in."""
    out: dict[str, torch.Tensor] = {}
    for index, offset in bucket.placements:
        meta = info.tensors[index]
        begin = start + offset
        out[meta.name] = wire_view(memory[begin : begin + meta.num_bytes], meta)
    return out


SPARE = SpareHelper()
