"""rlserve: a gRPC server in front of vLLM for RL trainers, and its clients.

Importing the package is cheap: the client and server modules load on first use.
"""

__version__ = "0.1.0"

__all__ = ["AsyncClient", "AsyncFleet", "Client", "Fleet", "__version__"]


def __getattr__(name: str):
    if name in ("Client", "AsyncClient"):
        from rlserve.sdk import client

        return getattr(client, name)
    if name in ("Fleet", "AsyncFleet"):
        from rlserve.sdk import fleet

        return getattr(fleet, name)
    raise AttributeError(name)
