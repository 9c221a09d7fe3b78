"""Many rlserve servers, on any hosts, driven by the trainer as one: `Fleet`.

One gloo group spans the trainer (rank 0) and the workers of every server (each server its
own range of ranks), so each chunk is voted on once and one broadcast reaches every server.
A sync is a two-phase commit:

    pause all -> start all -> chunks (every server stages and verifies each) ->
    prepare all (the vote) -> finish all with one version -> verify digests -> resume all

All or nothing holds up to the vote: a server that refuses a chunk, whose link breaks, that
dies or whose prepare fails makes every server abort; each keeps the weights and version it
served and generation resumes (`FleetSyncError.committed` is empty). After the vote a
server's commit is only a swap of tensors it already holds. A server that fails or dies
there is reported by name and dropped from the fleet (its own weights are inconsistent; it
refuses resume), the others serve the new version, and the call raises with per-server
outcomes. What no protocol gives: the servers do not switch in the same instant (requests
on one may see the new version a few milliseconds before those on another; every output
names its version), and a server that dies after the vote cannot be made to keep the old
weights.

`AsyncFleet` is its asyncio twin (the same fleet, its blocking calls in worker threads).

Membership changes between syncs: `add()` and `remove()` take effect at the next sync,
which rebuilds the group (a new rendezvous with every member); a server found unreachable
when a sync begins is dropped with a report and the sync goes on with the rest. Rollouts
over the same servers: `FleetRouter` (`fleet.generate`, `fleet.stream`,
`fleet.generate_many`).
"""

from rlserve.sdk.fanout import Outcome
from rlserve.sdk.fleet.async_fleet import AsyncFleet
from rlserve.sdk.fleet.fleet import Fleet
from rlserve.sdk.fleet.members import Dropped, FleetError, FleetSyncError, FleetSyncStats

__all__ = ["AsyncFleet", "Dropped", "Fleet", "FleetError", "FleetSyncError", "FleetSyncStats", "Outcome"]
