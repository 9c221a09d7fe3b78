"""The documented path of rlserve on Ray (`pip install rlserve[ray]`); it lives in
`rlserve.sdk.ray`."""

from rlserve.sdk.ray import RayFleet, launch_fleet

__all__ = ["RayFleet", "launch_fleet"]
