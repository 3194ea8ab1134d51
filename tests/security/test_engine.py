"""The engine's Generate server with TLS, mutual TLS and a bearer token; ``kv-engine serve``
reaching a locked-down offloadd with --offloadd-ca/--offloadd-cert/--offloadd-key/--offloadd-token-file."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.engine_loop import EngineLoop
from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from engine.server import create_server
from events.schema import BlockStored
from offloadd.client import ClientSecurity, OffloadClient
from rpc.auth import MISSING, WRONG
from rpc.tls import server_credentials
from tests.security.conftest import TOKEN, WRONG_TOKEN, start_daemon, write_token
from tests.security.pki import Pki
from tests.support.offloadd_proc import REPO


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model"), TinyModelSpec())


@pytest.fixture(scope="module")
def engine_port(model: Path, pki: Pki) -> Iterator[int]:
    """Generate over mutual TLS with a bearer token."""
    loop = EngineLoop(EngineCore(EngineConfig(model_dir=str(model), max_model_len=256))).start()
    creds = server_credentials(pki.server.cert, pki.server.key, pki.ca.ca_file)
    server, port = create_server(loop, "127.0.0.1:0", credentials=creds, token=TOKEN)
    server.start()
    yield port
    server.stop(grace=1).wait()
    loop.stop()


def _generate(channel: grpc.Channel) -> list[generate_pb2.GenerateResponse]:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=list(range(1, 40))),
        sampling=generate_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    return list(generate_pb2_grpc.GenerateStub(channel).Generate(request, timeout=30))


def _refusal(sec: ClientSecurity, target: str) -> tuple[grpc.StatusCode, str]:
    with sec.channel(target) as ch, pytest.raises(grpc.RpcError) as info:
        _generate(ch)
    return info.value.code(), info.value.details() or ""  # type: ignore[attr-defined]


def test_generate_needs_tls_client_cert_and_token(engine_port: int, pki: Pki) -> None:
    target = f"127.0.0.1:{engine_port}"
    mtls = ClientSecurity.from_files(pki.ca.ca_file, pki.client.cert, pki.client.key)
    with ClientSecurity(mtls.credentials, TOKEN).channel(target) as ch:
        out = _generate(ch)
        assert [r.finished for r in out] == [False, False, True]
    assert _refusal(mtls, target) == (grpc.StatusCode.UNAUTHENTICATED, MISSING)
    assert _refusal(ClientSecurity(mtls.credentials, WRONG_TOKEN), target) == (grpc.StatusCode.UNAUTHENTICATED, WRONG)
    for sec in (ClientSecurity(None, TOKEN),  # plaintext
                ClientSecurity(ClientSecurity.from_files(pki.ca.ca_file).credentials, TOKEN),  # no client cert
                ClientSecurity(ClientSecurity.from_files(pki.ca.ca_file, pki.other_client.cert,
                                                         pki.other_client.key).credentials, TOKEN)):
        assert _refusal(sec, target)[0] == grpc.StatusCode.UNAVAILABLE
    with mtls.channel(target) as ch:  # health: a client certificate, no token
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_cli_serve_with_tls_token_and_a_locked_offloadd(tmp_path: Path, model: Path, pki: Pki,
                                                        redis_url: str) -> None:
    token_file = write_token(tmp_path / "token", TOKEN)
    daemon = start_daemon(tmp_path / "d", redis_url, "engsec",
                          "--tls-cert-file", pki.server.cert, "--tls-key-file", pki.server.key,
                          "--tls-client-ca-file", pki.ca.ca_file, "--auth-token-file", token_file)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
         "--engine-id", "sec-engine", "--tls-cert", pki.server.cert, "--tls-key", pki.server.key,
         "--auth-token-file", token_file, "--offloadd", daemon.target, "--offload",
         "--offloadd-ca", pki.ca.ca_file, "--offloadd-cert", pki.client.cert, "--offloadd-key", pki.client.key,
         "--offloadd-token-file", token_file],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("kv-engine: serving on port "), proc.stderr.read() if proc.stderr else ""
        port = int(line.rsplit(" ", 1)[1])
        tls = ClientSecurity.from_files(pki.ca.ca_file).credentials
        with ClientSecurity(tls, TOKEN).channel(f"127.0.0.1:{port}") as ch:
            assert _generate(ch)[-1].finished
        assert _refusal(ClientSecurity(tls), f"127.0.0.1:{port}") == (grpc.StatusCode.UNAUTHENTICATED, MISSING)
        # The engine's KV events and host-tier stores reached the daemon through mTLS + token.
        client_sec = ClientSecurity.from_files(pki.ca.ca_file, pki.client.cert, pki.client.key)
        with OffloadClient(daemon.target, credentials=client_sec.credentials, token=TOKEN) as c:
            deadline = time.monotonic() + 15
            sources: set[str] = set()
            while time.monotonic() < deadline:
                sources = {r.source for r in c.subscribe(1) if any(isinstance(e, BlockStored) for e in r.events)}
                if "sec-engine" in sources and c.stats().num_blocks > 0:
                    break
                time.sleep(0.1)
            assert "sec-engine" in sources
            assert c.stats().num_engines == 1 and c.stats().num_blocks == 2  # 39 tokens: 2 full blocks of 16
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        daemon.stop()


def test_cli_refuses_bad_security_files(tmp_path: Path, model: Path, pki: Pki) -> None:
    cases = {
        ("--tls-cert", pki.server.cert): "TLS needs both a certificate file and a key file (got only one)",
        ("--auth-token-file", str(tmp_path / "none")): f"token file {str(tmp_path / 'none')!r}: No such file or directory",
        ("--offloadd-cert", pki.client.cert): "a client certificate needs both --*-cert and --*-key",
    }
    for args, message in cases.items():
        res = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0", *args],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert (res.returncode, res.stderr.strip().splitlines()[-1]) == (2, f"kv-engine: error: {message}")
        assert "Traceback" not in res.stderr
