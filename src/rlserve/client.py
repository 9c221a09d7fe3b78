"""The documented path of the gRPC clients; they live in `rlserve.sdk.client`."""

from rlserve.sdk.client import AsyncClient, ChannelCredentials, Client, Prompt, generate_request

__all__ = ["AsyncClient", "ChannelCredentials", "Client", "Prompt", "generate_request"]
