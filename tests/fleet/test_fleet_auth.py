"""Node-to-node reads use the engines' TLS/mTLS and token (issue 21): node a serves only mutual
TLS with a bearer token; node b, started with ``--fleet-ca-file`` and its own certificate and
token, fills an engine's Lookup miss from a; a node whose token is wrong gets nothing from a,
says why in its log (UNAUTHENTICATED), and answers its engine's Lookup as a miss."""

from __future__ import annotations

import datetime
import ipaddress
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from offloadd.client import BlockToStore, GroupQuery, OffloadClient
from tests.security.conftest import TOKEN, WRONG_TOKEN, SecureDaemon, write_token
from tests.security.pki import CertFiles, Pki, make_pki
from tests.support.synthetic_engine import GROUP, SLOT, block_bytes, digest, served_blocks_match

CHAIN = 12


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def node_cert(pki: Pki) -> CertFiles:
    """A node's certificate: it serves its engines and peers (server auth) and is presented
    to its peers (client auth), so it carries both extended key usages."""
    ca = pki.ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
        .issuer_name(ca.cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    cert_path, key_path = Path(ca.workdir) / "node.pem", Path(ca.workdir) / "node.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return CertFiles(str(cert_path), str(key_path))


def _node(work: Path, redis_url: str, namespace: str, pki: Pki, cert: CertFiles, token: str,
          *args: str) -> SecureDaemon:
    """A daemon that serves mutual TLS and a token on TCP (its engines here use the unix
    socket, with the token); ``args`` add its peers."""
    d = SecureDaemon(work, redis_url, namespace, capacity_bytes=4 * CHAIN * SLOT, extra_args=(
        "--tls-cert-file", cert.cert, "--tls-key-file", cert.key,
        "--tls-client-ca-file", pki.ca.ca_file,
        "--auth-token-file", write_token(work.parent / f"{namespace}.token", token), *args))
    d.start()
    return d


def _store_chain(d: SecureDaemon, token: str) -> list[bytes]:
    chain = [BlockToStore(digest("tls", i), digest("tls", i - 1) if i else None, (i, 1, 2, 3))
             for i in range(CHAIN)]
    with OffloadClient(f"unix:{d.unix_socket}", token=token) as c:
        arena = c.register_engine("a-eng", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            res = c.reserve("a-eng", 0, chain)
            for blk, (_, slot) in zip(chain, res.blocks, strict=True):
                arena.write(slot, block_bytes(blk.block_hash))
            c.commit("a-eng", res.reservation_id)
        finally:
            arena.close()
    return [b.block_hash for b in chain]


def _lookup(d: SecureDaemon, token: str, chain: list[bytes], want: int) -> tuple[int, int, list[bytes]]:
    """(the Lookup's prefix after the index caught up, blocks served, served with wrong bytes)."""
    with OffloadClient(f"unix:{d.unix_socket}", token=token) as c:
        arena = c.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            got = 0
            for _ in range(40):  # the fleet index follows a's log within ~50 ms
                got = c.lookup("b-eng", [GroupQuery(0, tuple(chain))]).results[0].num_prefix
                if got >= want:
                    break
                time.sleep(0.05)
            served, bad = served_blocks_match(c, "b-eng", arena, chain)
        finally:
            arena.close()
    return got, served, bad


def _peer_args(a: SecureDaemon, pki: Pki) -> tuple[str, ...]:
    return ("--fleet-peers", f"a=localhost:{a.port}/{a.namespace}", "--fleet-ca-file", pki.ca.ca_file,
            "--fleet-refresh-ms", "50", "--fleet-timeout-s", "2")


def test_a_peer_with_mtls_and_token_serves_a_fill(tmp_path: Path, redis_url: str, pki: Pki,
                                                  node_cert: CertFiles) -> None:
    a = _node(tmp_path / "a", redis_url, "tls-a", pki, node_cert, TOKEN)
    b = _node(tmp_path / "b", redis_url, "tls-b", pki, node_cert, TOKEN, *_peer_args(a, pki))
    try:
        chain = _store_chain(a, TOKEN)
        assert _lookup(b, TOKEN, chain, CHAIN) == (CHAIN, CHAIN, [])
        assert f"fleet fill: {CHAIN} blocks from a" in b.log_path.read_text()
    finally:
        a.kill()
        b.kill()


def test_a_wrong_token_is_refused_with_a_clear_error(tmp_path: Path, redis_url: str, pki: Pki,
                                                     node_cert: CertFiles) -> None:
    a = _node(tmp_path / "a", redis_url, "tls-a", pki, node_cert, TOKEN)
    b = _node(tmp_path / "b", redis_url, "tls-b", pki, node_cert, WRONG_TOKEN, *_peer_args(a, pki))
    try:
        chain = _store_chain(a, TOKEN)
        assert _lookup(b, WRONG_TOKEN, chain, 1) == (0, 0, [])
        log = b.log_path.read_text()
        assert "fleet read from a failed: UNAUTHENTICATED" in log, log[-2000:]
        with OffloadClient(f"unix:{b.unix_socket}", token=WRONG_TOKEN) as c:  # b is fine
            stats = c.stats()
        assert stats.num_blocks == 0 and all(s.num_reserved == 0 for s in stats.layouts)
        assert b.proc is not None and b.proc.poll() is None
    finally:
        a.kill()
        b.kill()
