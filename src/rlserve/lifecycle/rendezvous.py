"""Where a caller may make the server's workers connect: InitWeightTransferEngine names a
host, and without a check any caller could point the workers at any address. Allowed are
loopback, the caller's own address, and what the server lists (names, addresses, CIDR
blocks). A name is resolved, and every address it resolves to must be allowed."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable

from rlserve.errors import InvalidRequest, NotAllowed

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
RESOLVE_TIMEOUT_S = 5.0


async def check_trainer_host(host: str, caller_host: str, allowed: Iterable[str]) -> None:
    """Raises InvalidRequest (a name that does not resolve), NotAllowed."""
    addresses = await _resolve(host)
    networks = [net for entry in allowed for net in await _networks(entry)]
    caller = _address(caller_host)
    for address in addresses:
        if address.is_loopback or address == caller or any(address in net for net in networks):
            continue
        raise NotAllowed(
            f"init_info.master_address {host!r} ({address}) is not an allowed rendezvous host: the server "
            f"allows loopback, the caller's own address ({caller_host or 'a Unix socket'}) and its "
            "--transfer-allowed-hosts"
        )


async def _resolve(host: str) -> set[Address]:
    literal = _address(host)
    if literal is not None:
        return {literal}
    try:
        infos = await asyncio.wait_for(asyncio.to_thread(socket.getaddrinfo, host, None), RESOLVE_TIMEOUT_S)
    except (OSError, TimeoutError) as e:
        raise InvalidRequest("init_info_json", f"master_address {host!r} does not resolve: {e}") from e
    return {ipaddress.ip_address(info[4][0]) for info in infos}


async def _networks(entry: str) -> list[Network]:
    try:
        return [ipaddress.ip_network(entry, strict=False)]
    except ValueError:
        return [ipaddress.ip_network(a) for a in await _resolve(entry)]


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    # An IPv4 peer seen over an IPv6 socket.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
