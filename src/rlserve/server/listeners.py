"""The listening addresses: which services each one serves, its transport security (TLS,
mutual TLS), and the access interceptor in front of all of it. One listener serves
everything unless the control plane has an address of its own; health and reflection are
served on every listener."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc
from rlserve.api.vllm import (
    aliases_pb2,
    aliases_pb2_grpc,
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)
from rlserve.config import AUTH_TOKENS_ENV, SecurityConfig, ServeConfig
from rlserve.server import reflection
from rlserve.server.access import AccessInterceptor
from rlserve.server.auth import CredentialSource, Listener
from rlserve.server.health import Health

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
CONTROL_SERVICE = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
LIFECYCLE_SERVICE = lifecycle_pb2.DESCRIPTOR.services_by_name["Lifecycle"].full_name
# Served by the same servicers (see auth.ALIASES).
GENERATE_ALIAS = aliases_pb2.DESCRIPTOR.services_by_name["Generate"].full_name
RL_CONTROL_ALIAS = aliases_pb2.DESCRIPTOR.services_by_name["RlControl"].full_name
# vllm.Inference under both its names: NOT_SERVING in health while generation is paused.
INFERENCE_SERVICES = (INFERENCE_SERVICE, GENERATE_ALIAS)
SERVICE_NAMES = (*INFERENCE_SERVICES, CONTROL_SERVICE, RL_CONTROL_ALIAS, LIFECYCLE_SERVICE)


class AddressInUse(OSError):
    """A listening address could not be bound (another process holds it, most often)."""


@dataclass(frozen=True)
class Servicers:
    inference: inference_pb2_grpc.InferenceServicer
    control: control_pb2_grpc.ControlServicer
    lifecycle: lifecycle_pb2_grpc.LifecycleServicer
    health: Health


@dataclass
class Listening:
    """`shared`: the server's frontend processes all serve this address (SO_REUSEPORT);
    `joins`: this process joins an address its leader holds already."""

    address: str
    kind: Listener
    server: grpc.aio.Server
    shared: bool = False
    joins: bool = False
    port: int = 0


def plan(config: ServeConfig, inference_only: bool = False) -> list[tuple[str, Listener]]:
    if inference_only:  # a following frontend process (the leader serves the control plane)
        return [(config.address, Listener.INFERENCE)]
    if not config.control_address:
        return [(config.address, Listener.ALL)]
    return [(config.address, Listener.INFERENCE), (config.control_address, Listener.CONTROL)]


def credential_source(security: SecurityConfig) -> CredentialSource | None:
    """None when no tokens are configured (client certificates may still authenticate)."""
    if security.auth_tokens_file is not None:
        path = security.auth_tokens_file
        return CredentialSource(lambda: Path(path).read_text(), str(path))
    if security.auth_tokens_text is not None:
        text = security.auth_tokens_text
        return CredentialSource(lambda: text, AUTH_TOKENS_ENV)
    return None


def build(
    config: ServeConfig,
    servicers: Servicers,
    credentials: CredentialSource | None,
    record: Callable[[str, str, str], None],
    observe: Callable[[str, str, float], None],
    inference_only: bool = False,
) -> list[Listening]:
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        # gRPC cancels calls at random (early detection) once this many wait to be dispatched
        # (1000 by default): a burst of requests held during a pause must reach rlserve's own
        # bounds (max_held_requests: RESOURCE_EXHAUSTED) instead.
        ("grpc.server.max_pending_requests", 2 * max(config.max_held_requests, 1024)),
        ("grpc.server.max_pending_requests_hard_limit", 4 * max(config.max_held_requests, 1024)),
    ]
    listenings = []
    for address, kind in plan(config, inference_only):
        interceptor = AccessInterceptor(
            listener=kind,
            credentials=credentials,
            client_certificates=config.security.tls_client_ca_file is not None,
            record=record,
            observe=observe,
        )
        # gRPC binds with SO_REUSEPORT unless told not to: a second server on a port another
        # one holds would bind it too and take part of its connections. Only a server's own
        # frontend processes share its inference port.
        shared = kind is Listener.INFERENCE and config.num_frontends > 1
        server = grpc.aio.server(interceptors=[interceptor], options=[*options, ("grpc.so_reuseport", int(shared))])
        names = [health.SERVICE_NAME]
        if kind is not Listener.CONTROL:
            inference_pb2_grpc.add_InferenceServicer_to_server(servicers.inference, server)
            aliases_pb2_grpc.add_GenerateServicer_to_server(servicers.inference, server)
            names += INFERENCE_SERVICES
        # On the inference listener the interceptor lets only Control's reads through.
        control_pb2_grpc.add_ControlServicer_to_server(servicers.control, server)
        names.append(CONTROL_SERVICE)
        if kind is not Listener.INFERENCE:
            aliases_pb2_grpc.add_RlControlServicer_to_server(servicers.control, server)
            lifecycle_pb2_grpc.add_LifecycleServicer_to_server(servicers.lifecycle, server)
            names += [RL_CONTROL_ALIAS, LIFECYCLE_SERVICE]
        health_pb2_grpc.add_HealthServicer_to_server(servicers.health, server)
        reflection.enable(names, server)
        listenings.append(Listening(address, kind, server, shared=shared, joins=inference_only))
    return listenings


async def start(listenings: list[Listening], security: SecurityConfig) -> None:
    credentials = server_credentials(security)
    for listening in listenings:
        server, address = listening.server, listening.address
        if listening.shared and not listening.joins:
            _refuse_if_held(address)
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as e:  # how grpc says bind() failed
            raise AddressInUse(f"could not bind {address} (in use by another process?): {e}") from None
        if port == 0:
            raise AddressInUse(f"could not bind {address} (in use by another process?)")
        listening.port = port
        await server.start()


def _refuse_if_held(address: str) -> None:
    """AddressInUse if anything listens on `address` (HOST:PORT) already: the leader of several
    frontends binds with SO_REUSEPORT (its followers join it), which would not fail on a port
    another process's gRPC server holds. A plain bind does."""
    host, _, port = address.rpartition(":")
    if address.startswith("unix:") or port in ("", "0"):
        return
    for family, kind, proto, _, where in socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: past TIME_WAIT
            try:
                probe.bind(where)
            except OSError as e:
                raise AddressInUse(f"could not bind {address} (in use by another process?): {e}") from None


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    if security.tls_cert_file is None or security.tls_key_file is None:
        return None
    key, cert = security.tls_key_file.read_bytes(), security.tls_cert_file.read_bytes()
    client_ca = security.tls_client_ca_file.read_bytes() if security.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
