"""The documented path of the fleet (many servers synced as one); it lives in `rlserve.sdk.fleet`."""

from rlserve.sdk.fleet import AsyncFleet, Dropped, Fleet, FleetError, FleetSyncError, FleetSyncStats, Outcome

__all__ = ["AsyncFleet", "Dropped", "Fleet", "FleetError", "FleetSyncError", "FleetSyncStats", "Outcome"]
