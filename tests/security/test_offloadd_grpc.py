"""offloadd as a real process with TLS, mutual TLS and a bearer token: who gets in, who does not,
and with what status; health stays open, reflection does not; the unix socket's mode."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from events.schema import BlockStored
from offloadd.client import (
    ClientSecurity,
    IngestStream,
    OffloadClient,
    OffloadClientError,
)
from rpc.auth import MISSING, WRONG
from stack.healthcheck import grpc_serving
from tests.security.conftest import (
    TOKEN,
    WRONG_TOKEN,
    SecureDaemon,
    other_group,
    start_daemon,
    write_token,
)
from tests.security.pki import Pki
from tests.support.offloadd_proc import REPO
from tests.support.redis_proc import RedisProcess


@pytest.fixture(scope="module")
def redis_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess, pki: Pki) -> Iterator[SecureDaemon]:
    """TLS only: no client certificate, no token."""
    d = start_daemon(tmp_path_factory.mktemp("tls"), redis_proc.url, "tls",
                     "--tls-cert-file", pki.server.cert, "--tls-key-file", pki.server.key)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def locked_daemon(tmp_path_factory: pytest.TempPathFactory, redis_proc: RedisProcess, pki: Pki) -> Iterator[SecureDaemon]:
    """Mutual TLS and a bearer token."""
    work = tmp_path_factory.mktemp("locked")
    token_file = write_token(work / "token", TOKEN)
    d = start_daemon(work / "d", redis_proc.url, "locked",
                     "--tls-cert-file", pki.server.cert, "--tls-key-file", pki.server.key,
                     "--tls-client-ca-file", pki.ca.ca_file, "--auth-token-file", token_file)
    yield d
    d.stop()


def _status(fn: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(OffloadClientError) as info:
        fn()  # type: ignore[operator]
    return info.value.code, info.value.message


def test_tls_client_works_plaintext_client_fails(tls_daemon: SecureDaemon, pki: Pki) -> None:
    creds = ClientSecurity.from_files(pki.ca.ca_file).credentials
    with OffloadClient(tls_daemon.target, credentials=creds) as c:
        assert c.stats().num_blocks == 0
    with OffloadClient(tls_daemon.target, timeout_s=1.0) as c:
        code, _ = _status(c.stats)
    assert code == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses the server's certificate.
    wrong_ca = ClientSecurity.from_files(pki.other_ca.ca_file).credentials
    with OffloadClient(tls_daemon.target, timeout_s=1.0, credentials=wrong_ca) as c:
        code, _ = _status(c.stats)
    assert code == grpc.StatusCode.UNAVAILABLE
    # Probes with the CA see SERVING over TLS.
    ok, why = grpc_serving(tls_daemon.target, security=ClientSecurity(creds))
    assert (ok, why) == (True, f"{tls_daemon.target}: SERVING")


def test_mutual_tls_requires_a_certificate_of_the_trusted_ca(locked_daemon: SecureDaemon, pki: Pki) -> None:
    cases = {
        "no client cert": ClientSecurity.from_files(pki.ca.ca_file, token_file=""),
        "other CA's cert": ClientSecurity.from_files(pki.ca.ca_file, pki.other_client.cert, pki.other_client.key),
    }
    for why, sec in cases.items():
        with OffloadClient(locked_daemon.target, timeout_s=1.0, credentials=sec.credentials, token=TOKEN) as c:
            code, _ = _status(c.stats)
        assert code == grpc.StatusCode.UNAVAILABLE, why
    good = ClientSecurity.from_files(pki.ca.ca_file, pki.client.cert, pki.client.key)
    with OffloadClient(locked_daemon.target, credentials=good.credentials, token=TOKEN) as c:
        assert c.stats().capacity_bytes == 1 << 16


def test_token_missing_or_wrong_is_unauthenticated(locked_daemon: SecureDaemon, pki: Pki) -> None:
    creds = ClientSecurity.from_files(pki.ca.ca_file, pki.client.cert, pki.client.key).credentials
    with OffloadClient(locked_daemon.target, credentials=creds) as c:
        assert _status(c.stats) == (grpc.StatusCode.UNAUTHENTICATED, MISSING)
        assert _status(lambda: list(c.subscribe(1))) == (grpc.StatusCode.UNAUTHENTICATED, MISSING)
    with OffloadClient(locked_daemon.target, credentials=creds, token=WRONG_TOKEN) as c:
        assert _status(c.stats) == (grpc.StatusCode.UNAUTHENTICATED, WRONG)
        assert _status(lambda: c.read_blocks("e", 0, [b"x" * 32])) == (grpc.StatusCode.UNAUTHENTICATED, WRONG)
    # The unix socket is one more door into the same server: the token is required there too.
    with OffloadClient(f"unix:{locked_daemon.unix_socket}") as c:
        assert _status(c.stats) == (grpc.StatusCode.UNAUTHENTICATED, MISSING)
    with OffloadClient(f"unix:{locked_daemon.unix_socket}", token=TOKEN) as c:
        assert c.stats().num_blocks == 0


def test_health_is_open_reflection_is_not(locked_daemon: SecureDaemon, pki: Pki) -> None:
    sec = ClientSecurity.from_files(pki.ca.ca_file, pki.client.cert, pki.client.key)
    for token in (None, TOKEN):
        with ClientSecurity(sec.credentials, token).channel(locked_daemon.target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            if token is None:
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.ServerReflectionInfo(iter([request]), timeout=5))
                assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, MISSING)  # type: ignore[attr-defined]
            else:
                (reply_r,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
                assert "kvcache.v1.OffloadStore" in {s.name for s in reply_r.list_services_response.service}


def test_ingest_stream_and_client_with_tls_and_token(locked_daemon: SecureDaemon, pki: Pki) -> None:
    sec = ClientSecurity.from_files(pki.ca.ca_file, pki.client.cert, pki.client.key)
    stream = IngestStream(locked_daemon.target, "eng-sec", 7, credentials=sec.credentials, token=TOKEN)
    try:
        for i in range(5):
            stream.submit([BlockStored((100 + i,), 99 + i if i else None, (1, 2, 3, 4), 4, "GPU")])
        assert stream.flush(10)
        assert stream.acked_seq == 5
    finally:
        stream.close()
    unauth = IngestStream(locked_daemon.target, "eng-bad", 8, credentials=sec.credentials,
                          token=WRONG_TOKEN, backoff_s=(0.05, 0.1))
    try:
        unauth.submit([BlockStored((1,), None, (1, 2, 3, 4), 4, "GPU")])
        assert not unauth.flush(1.0)
        assert unauth.acked_seq == 0 and unauth.last_error == f"UNAUTHENTICATED: {WRONG}"
    finally:
        unauth.close()

    with OffloadClient(locked_daemon.target, credentials=sec.credentials, token=TOKEN) as client:
        assert client.stats().num_blocks == 0
        hashes = [h for record in client.subscribe(1) for e in record.events
                  if isinstance(e, BlockStored) for h in e.block_hashes]
    assert hashes == [100, 101, 102, 103, 104]


def test_unix_socket_is_owner_only_by_default(tls_daemon: SecureDaemon) -> None:
    assert stat.S_ISSOCK(os.stat(tls_daemon.unix_socket).st_mode)
    assert stat.S_IMODE(os.stat(tls_daemon.unix_socket).st_mode) == 0o600


def test_unix_socket_mode_and_group(tmp_path: Path, redis_proc: RedisProcess) -> None:
    group, gid = other_group()
    d = start_daemon(tmp_path, redis_proc.url, "sockmode", "--unix-socket-mode", "660",
                     "--unix-socket-group", group)
    try:
        st = os.stat(d.unix_socket)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, gid)
    finally:
        d.stop()


def _offloadd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "offloadd", "--metrics-port=-1", *args],
                          capture_output=True, text=True, timeout=30, env=env, cwd=REPO)


def test_bad_security_settings_are_refused_without_traceback(tmp_path: Path, pki: Pki) -> None:
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    empty.chmod(0o600)
    cases = {
        ("--tls-cert-file", pki.server.cert): "TLS needs both a certificate file and a key file (got only one)",
        ("--tls-client-ca-file", pki.ca.ca_file): "a client CA (mutual TLS) needs a TLS certificate and key as well",
        ("--auth-token-file", str(tmp_path / "nope")): f"token file {str(tmp_path / 'nope')!r}: No such file or directory",
        ("--auth-token-file", str(empty)): f"token file {str(empty)!r} is empty",
        ("--unix-socket-mode", "999"): "unix_socket_mode: invalid literal for int() with base 8: '999'",
        ("--unix-socket-group", "no-such-group-x"): "unix_socket_group: no such group 'no-such-group-x'",
    }
    for args, message in cases.items():
        out = _offloadd(*args)
        assert (out.returncode, out.stderr.strip()) == (2, f"offloadd: {message}"), args
    missing_key = str(tmp_path / "missing.key")
    out = _offloadd("--tls-cert-file", pki.server.cert, "--tls-key-file", missing_key,
                    "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2
    assert f"cannot start: TLS key {missing_key!r}: No such file or directory" in out.stderr
    assert "Traceback" not in out.stderr
