"""Authentication and authorization for real: bearer tokens (rotated while serving), mutual TLS
with role-carrying certificates, split inference / control listeners, the refusal to serve
an unauthenticated control plane beyond loopback, rendezvous host checks, and the audit
trail. Every refused call changes nothing (version, paused state)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from certs import CertificateAuthority
from cryptography.x509 import NameAttribute as attribute
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import control_pb2_grpc, inference_pb2, inference_pb2_grpc
from rlserve.config import SecurityConfig, ServeConfig
from rlserve.sdk.client import AsyncClient, ChannelCredentials, generate_request, open_aio_channel
from rlserve.server.auth import RULES, rule_for

from helpers import expect

ADMIN_TOKEN = "admin-token-0123456789abcdef"
READ_TOKEN = "read-token-0123456789abcdef"
NEW_ADMIN_TOKEN = "new-admin-token-0123456789abcdef"
UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


def test_every_served_method_has_an_access_rule():
    from rlserve.api.rlserve.v1 import lifecycle_pb2
    from rlserve.api.vllm import control_pb2

    served = [
        f"/{service.full_name}/{method.name}"
        for module in (inference_pb2, control_pb2, lifecycle_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]
    missing = [m for m in served if rule_for(m) is None]
    assert not missing, missing
    assert set(RULES) == set(served), "no rule for a method that is not served"


@contextlib.asynccontextmanager
async def secured(engine, engine_config, **security):
    """A server with `security` over the shared engine (generation left running)."""
    from rlserve.server.app import RlserveServer

    control_address = security.pop("control_address", "")
    config = ServeConfig(
        engine=engine_config, port=0, control_address=control_address, security=SecurityConfig(**security)
    )
    server = RlserveServer(config)
    await server.start()
    await server.attach_engine(engine)
    try:
        yield server
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def stubs(target: str, credentials: ChannelCredentials | None = None):
    async with open_aio_channel(target, credentials) as channel:
        yield (
            control_pb2_grpc.ControlStub(channel),
            inference_pb2_grpc.InferenceStub(channel),
            lifecycle_pb2_grpc.LifecycleStub(channel),
            channel,
        )


@pytest.fixture
def tokens_file(tmp_path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"# role token name\nadmin {ADMIN_TOKEN} trainer\nread {READ_TOKEN} router\n")
    return path


async def unchanged(lifecycle_with_admin, version: str, paused: bool) -> None:
    state = await lifecycle_with_admin.GetState(lpb.GetStateRequest())
    assert state.weight_version == version and (state.pause_phase != lpb.PAUSE_PHASE_RUNNING) == paused


MUTATIONS = [
    ("PauseGeneration", cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_ABORT)),
    ("UpdateWeightVersion", cpb.UpdateWeightVersionRequest(weight_version="stolen")),
    ("Abort", cpb.AbortRequest(request_ids=["x"])),
    ("StartWeightUpdate", cpb.StartWeightUpdateRequest()),
]


async def test_tokens_roles_and_refusals_change_nothing(engine, engine_config, tokens_file):
    async with secured(engine, engine_config, auth_tokens_file=tokens_file) as server:
        target = f"127.0.0.1:{server.port}"
        async with stubs(target, ChannelCredentials(token=ADMIN_TOKEN)) as (admin, _, admin_lifecycle, _):
            version = (await admin.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version
            for credentials, code in (
                (None, UNAUTHENTICATED),
                (ChannelCredentials(token="wrong" * 5), UNAUTHENTICATED),
            ):
                async with stubs(target, credentials) as (control, inference, lifecycle, channel):
                    await expect(code, inference.Generate(generate_request("hi", max_new_tokens=2)))
                    await expect(code, lifecycle.GetState(lpb.GetStateRequest()))
                    for name, request in MUTATIONS:
                        await expect(code, getattr(control, name)(request))
                    # Health and reflection need no credential.
                    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                    assert health.status == health_pb2.HealthCheckResponse.SERVING
            async with stubs(target, ChannelCredentials(token=READ_TOKEN)) as (control, inference, lifecycle, _):
                out = await inference.Generate(generate_request("hi", max_new_tokens=2))
                assert out.outputs.finish_info.num_output_tokens == 2
                assert (await lifecycle.GetState(lpb.GetStateRequest())).weight_version == version
                for name, request in MUTATIONS:
                    details = await expect(DENIED, getattr(control, name)(request))
                    assert "admin" in details and "router" in details
            await unchanged(admin_lifecycle, version, paused=False)
            await admin.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
            await admin.ResumeGeneration(cpb.ResumeGenerationRequest())
            audit = (await admin_lifecycle.GetState(lpb.GetStateRequest())).recent_mutations
            refused = [a for a in audit if a.outcome == "PERMISSION_DENIED"]
            assert refused and all("router(read)" in a.caller for a in refused)
            assert any(a.operation == "pause" and a.caller.startswith("trainer(admin)") for a in audit)


async def test_tokens_rotate_on_reload_and_a_bad_file_keeps_the_old_ones(engine, engine_config, tokens_file):
    async with secured(engine, engine_config, auth_tokens_file=tokens_file) as server:
        target = f"127.0.0.1:{server.port}"
        tokens_file.write_text(f"admin {NEW_ADMIN_TOKEN}\n")
        server.reload_credentials()  # what SIGHUP does
        async with stubs(target, ChannelCredentials(token=ADMIN_TOKEN)) as (control, *_):
            await expect(UNAUTHENTICATED, control.IsPaused(cpb.IsPausedRequest()))
        tokens_file.write_text("superuser nonsense\n")
        server.reload_credentials()
        async with stubs(target, ChannelCredentials(token=NEW_ADMIN_TOKEN)) as (control, *_):
            await control.ResumeGeneration(cpb.ResumeGenerationRequest())


async def test_the_audit_log_has_one_json_line_per_mutation_and_refusal_and_no_token(
    engine, engine_config, tokens_file, caplog
):
    caplog.set_level(logging.INFO, logger="rlserve.audit")
    async with secured(engine, engine_config, auth_tokens_file=tokens_file) as server:
        target = f"127.0.0.1:{server.port}"
        async with stubs(target, ChannelCredentials(token=ADMIN_TOKEN)) as (control, *_):
            await control.ResumeGeneration(cpb.ResumeGenerationRequest())
        async with stubs(target, ChannelCredentials(token=READ_TOKEN)) as (control, *_):
            await expect(DENIED, control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="v")))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "rlserve.audit"]
    by_method = {line["method"]: line for line in lines}
    ok = by_method["/vllm.Control/ResumeGeneration"]
    assert (ok["identity"], ok["role"], ok["outcome"]) == ("trainer", "admin", "OK") and ok["duration_ms"] >= 0
    refused = by_method["/vllm.Control/UpdateWeightVersion"]
    assert (refused["identity"], refused["outcome"]) == ("router", "PERMISSION_DENIED") and "v" in refused["args"]
    assert all(ADMIN_TOKEN not in r.getMessage() and READ_TOKEN not in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, other = CertificateAuthority(directory, "ca"), CertificateAuthority(directory, "other-ca")
    return {
        "ca": ca.pem,
        "server": ca.issue("server", "localhost", server=True),
        "admin": ca.issue("admin", "trainer-1", "rlserve-admin"),
        "reader": ca.issue("reader", "dashboard", "rlserve-read"),
        "nobody": ca.issue("nobody", "stranger"),
        "expired": ca.issue("expired", "trainer-2", "rlserve-admin", expired=True),
        "untrusted": other.issue("untrusted", "trainer-3", "rlserve-admin"),
        # Subjects a CA may sign without noticing what they spell when printed (RFC 2253
        # escapes the ',' inside a value as '\,'): none of them is admin.
        "comma_in_cn": ca.issue("comma_in_cn", "mallory,OU=rlserve-admin", "rlserve-read"),
        "comma_in_cn_alone": ca.issue("comma_in_cn_alone", "mallory,OU=rlserve-admin"),
        "comma_in_o": ca.issue(
            "comma_in_o", "mallory", "rlserve-read", attribute(NameOID.ORGANIZATION_NAME, "x,OU=rlserve-admin")
        ),
        "both_roles": ca.issue(
            "both_roles", "eve", "rlserve-read", attribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "rlserve-admin")
        ),
        "two_names": ca.issue("two_names", "dashboard", "rlserve-read", attribute(NameOID.COMMON_NAME, "trainer-1")),
        "control_chars": ca.issue("control_chars", 'evil\n{"identity": "trainer"}', "rlserve-read"),
    }


def tls(pki, client: str | None) -> ChannelCredentials:
    return ChannelCredentials.from_files(
        root_certificates=pki["ca"].cert,
        certificate_chain=pki[client].cert if client else None,
        private_key=pki[client].key if client else None,
        server_name="localhost",
    )


async def test_mutual_tls_identities_and_roles(engine, engine_config, pki, caplog):
    caplog.set_level(logging.INFO, logger="rlserve.audit")
    server_pem = pki["server"]
    async with secured(
        engine,
        engine_config,
        tls_cert_file=server_pem.cert,
        tls_key_file=server_pem.key,
        tls_client_ca_file=pki["ca"].cert,
    ) as server:
        target = f"127.0.0.1:{server.port}"
        async with stubs(target, tls(pki, "admin")) as (control, inference, lifecycle, _):
            await control.ResumeGeneration(cpb.ResumeGenerationRequest())
            assert (await inference.Generate(generate_request("hi", max_new_tokens=2))).outputs.num_tokens == 2
        async with stubs(target, tls(pki, "reader")) as (control, _, lifecycle, _):
            await lifecycle.GetState(lpb.GetStateRequest())
            assert "dashboard" in await expect(DENIED, control.ResumeGeneration(cpb.ResumeGenerationRequest()))
        async with stubs(target, tls(pki, "nobody")) as (control, *_):
            await expect(UNAUTHENTICATED, control.IsPaused(cpb.IsPausedRequest()))
        # A role spelled inside another attribute's value is no role; both roles is the lesser.
        for client in ("comma_in_cn", "comma_in_o", "both_roles"):
            async with stubs(target, tls(pki, client)) as (control, _, lifecycle, _):
                await lifecycle.GetState(lpb.GetStateRequest())
                assert "has read" in await expect(DENIED, control.ResumeGeneration(cpb.ResumeGenerationRequest()))
        async with stubs(target, tls(pki, "comma_in_cn_alone")) as (control, *_):
            await expect(UNAUTHENTICATED, control.ResumeGeneration(cpb.ResumeGenerationRequest()))
        async with stubs(target, tls(pki, "two_names")) as (control, *_):
            assert "2 common names" in await expect(UNAUTHENTICATED, control.IsPaused(cpb.IsPausedRequest()))
        async with stubs(target, tls(pki, "control_chars")) as (control, *_):
            details = await expect(DENIED, control.ResumeGeneration(cpb.ResumeGenerationRequest()))
            assert "\n" not in details and "evil\\n" in details
        for client in ("expired", "untrusted", None):  # the handshake itself fails
            async with stubs(target, tls(pki, client)) as (control, *_):
                await expect(grpc.StatusCode.UNAVAILABLE, control.IsPaused(cpb.IsPausedRequest(), timeout=5))
    audit = [json.loads(r.getMessage()) for r in caplog.records if r.name == "rlserve.audit"]
    identities = {line["identity"] for line in audit if line["outcome"] == "PERMISSION_DENIED"}
    # The parsed common name, escaped: a newline in a CN cannot start a forged log line.
    assert identities == {"dashboard", "mallory,OU=rlserve-admin", "mallory", "eve", 'evil\\n{"identity": "trainer"}'}


async def test_split_listeners_serve_inference_and_control_apart(engine, engine_config, tokens_file, tmp_path):
    control_socket = f"unix:{tmp_path / 'control.sock'}"
    async with secured(engine, engine_config, auth_tokens_file=tokens_file, control_address=control_socket) as server:
        inference_target = f"127.0.0.1:{server.port}"
        async with stubs(inference_target, ChannelCredentials(token=ADMIN_TOKEN)) as (
            control,
            inference,
            lifecycle,
            ch,
        ):
            assert (await inference.Generate(generate_request("hi", max_new_tokens=2))).outputs.num_tokens == 2
            await control.GetModelInfo(cpb.GetModelInfoRequest())  # routers read server info here
            assert "control address" in await expect(DENIED, control.PauseGeneration(cpb.PauseGenerationRequest()))
            await expect(grpc.StatusCode.UNIMPLEMENTED, lifecycle.GetState(lpb.GetStateRequest()))
        async with stubs(control_socket, ChannelCredentials(token=ADMIN_TOKEN)) as (control, inference, lifecycle, ch):
            await control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
            await control.ResumeGeneration(cpb.ResumeGenerationRequest())
            await lifecycle.GetState(lpb.GetStateRequest())
            await expect(grpc.StatusCode.UNIMPLEMENTED, inference.Generate(generate_request("hi", max_new_tokens=2)))
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_an_unauthenticated_control_plane_beyond_loopback_is_refused():
    """`rlserve serve` exits with status 2 before it loads anything."""
    cmd = [sys.executable, "-m", "rlserve", "serve", "--model", "/nonexistent", "--host", "0.0.0.0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "without authentication" in done.stderr


async def test_insecure_control_is_reported(engine, engine_config):
    from rlserve.server.app import RlserveServer

    config = ServeConfig(engine=engine_config, host="0.0.0.0", port=0, security=SecurityConfig(insecure_control=True))
    server = RlserveServer(config)
    await server.start()
    await server.attach_engine(engine)
    try:
        async with stubs(f"127.0.0.1:{server.port}") as (_, _, lifecycle, _):
            assert (await lifecycle.GetState(lpb.GetStateRequest())).insecure_control
    finally:
        await server.stop(0)


async def test_the_rendezvous_must_name_an_allowed_host(wt_engine, engine_config, tokens_file):
    wt_config = replace(engine_config, weight_transfer_backend="rlserve_gloo")
    info = {"master_address": "192.0.2.7", "master_port": 29500, "rank_offset": 1, "world_size": 2, "timeout_s": 1}
    request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(info).encode())
    async with secured(wt_engine, wt_config, auth_tokens_file=tokens_file) as server:
        async with stubs(f"127.0.0.1:{server.port}", ChannelCredentials(token=ADMIN_TOKEN)) as (
            control,
            _,
            lifecycle,
            _,
        ):
            assert "allowed rendezvous host" in await expect(DENIED, control.InitWeightTransferEngine(request))
            assert not (await lifecycle.GetState(lpb.GetStateRequest())).transport_initializing
    async with secured(
        wt_engine, wt_config, auth_tokens_file=tokens_file, transfer_allowed_hosts=("192.0.2.0/24",)
    ) as server:
        async with stubs(f"127.0.0.1:{server.port}", ChannelCredentials(token=ADMIN_TOKEN)) as (control, *_):
            # Allowed now: nobody is there, so it ends at its deadline instead.
            await expect(grpc.StatusCode.DEADLINE_EXCEEDED, control.InitWeightTransferEngine(request))


async def test_the_sdk_speaks_tokens_and_tls(engine, engine_config, pki, tokens_file):
    server_pem = pki["server"]
    async with secured(
        engine, engine_config, auth_tokens_file=tokens_file, tls_cert_file=server_pem.cert, tls_key_file=server_pem.key
    ) as server:
        credentials = ChannelCredentials.from_files(
            token=READ_TOKEN, root_certificates=pki["ca"].cert, server_name="localhost"
        )
        async with AsyncClient(f"127.0.0.1:{server.port}", credentials=credentials) as client:
            await client.wait_ready(timeout_s=10)
            assert (await client.generate("hi", max_new_tokens=2)).outputs.num_tokens == 2
        from rlserve.sdk.client import Client

        def blocking() -> int:
            with Client(f"127.0.0.1:{server.port}", credentials=credentials) as client:
                return client.generate("hi", max_new_tokens=3).outputs.num_tokens

        assert await asyncio.to_thread(blocking) == 3


def test_tokens_file_parsing_never_quotes_a_token():
    from rlserve.server.auth import CertificateSubject, Credentials, Role

    creds = Credentials.parse(
        f"# comment\nadmin {ADMIN_TOKEN} trainer  # trailing\n\nread {READ_TOKEN}\nread cert:dash\n"
    )
    assert creds.for_token(ADMIN_TOKEN).role is Role.ADMIN and creds.for_token(ADMIN_TOKEN).name == "trainer"
    assert creds.for_token(READ_TOKEN).name.startswith("token-") and creds.for_token("x" * 30) is None
    assert creds.for_certificate(CertificateSubject("dash", ())).role is Role.READ
    assert creds.for_certificate(CertificateSubject("anyone", ("rlserve-admin",))).role is Role.ADMIN
    assert creds.for_certificate(CertificateSubject("anyone", ("rlserve-admin", "rlserve-read"))).role is Role.READ
    assert creds.for_certificate(CertificateSubject("anyone", ("other",))) is None
    for bad, why in ((f"root {ADMIN_TOKEN}", "role"), ("admin short", "16 characters"), ("admin", "ROLE TOKEN")):
        with pytest.raises(ValueError, match=why) as e:
            Credentials.parse(bad)
        assert ADMIN_TOKEN not in str(e.value) and "short" not in str(e.value)


async def test_rendezvous_hosts():
    from rlserve.errors import InvalidRequest, NotAllowed
    from rlserve.lifecycle.rendezvous import check_trainer_host

    await check_trainer_host("127.0.0.1", "", ())
    await check_trainer_host("localhost", "", ())
    await check_trainer_host("10.0.0.5", "10.0.0.5", ())  # the caller's own address
    await check_trainer_host("::ffff:10.0.0.5", "10.0.0.5", ())
    await check_trainer_host("10.1.2.3", "", ("10.1.0.0/16",))
    with pytest.raises(NotAllowed):
        await check_trainer_host("10.0.0.6", "10.0.0.5", ("10.1.0.0/16",))
    with pytest.raises(InvalidRequest):
        await check_trainer_host("no-such-host.invalid", "", ())
