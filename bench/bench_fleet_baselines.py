"""The bare transports bench_fleet.py compares the cross-node transfer with: the same bytes
over a gRPC stream, a TCP socket (threads of one process, or a sender in another process) and a
TLS socket."""

from __future__ import annotations

import datetime
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc


def bare_grpc(payloads: list[bytes]) -> float:
    def stream(_req: bytes, _ctx: Any) -> Iterator[bytes]:
        yield from payloads

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.method_handlers_generic_handler("bench.Bytes", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_stream("/bench.Bytes/Stream", None, None)
            t0 = time.perf_counter()
            got = sum(len(m) for m in call(b""))
            dt = time.perf_counter() - t0
    finally:
        server.stop(0)
    assert got == sum(len(p) for p in payloads)
    return dt


def _timed_recv(sock: socket.socket, view: memoryview) -> tuple[int, float]:
    """Receive into ``view`` until it is full or the sender closes: bytes received, seconds."""
    t0 = time.perf_counter()
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            break
        got += n
    return got, time.perf_counter() - t0


def bare_tcp(payloads: list[bytes]) -> float:
    total = sum(len(p) for p in payloads)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def send() -> None:
        conn, _ = srv.accept()
        with conn:
            for p in payloads:
                conn.sendall(p)

    t = threading.Thread(target=send)
    t.start()
    view = memoryview(bytearray(total))
    with socket.create_connection(("127.0.0.1", port)) as s:
        got, dt = _timed_recv(s, view)
    t.join()
    srv.close()
    assert got == total
    return dt


def bare_tcp_other_process(payloads: list[bytes], work: Path) -> float:
    """Bare TCP with the sender in another process (as the block port's peer is): the same
    bytes, sent from a file with ``sendfile``, received into one buffer; timed from the
    child's first byte."""
    src = work / "bare-src"
    src.write_bytes(b"".join(payloads))
    total = src.stat().st_size
    srv = socket.create_server(("127.0.0.1", 0))
    sender = subprocess.Popen([sys.executable, "-c", _SENDFILE_CHILD, str(srv.fileno()), str(src)],
                              pass_fds=(srv.fileno(),))
    view = memoryview(bytearray(total))
    with socket.create_connection(srv.getsockname()) as s:
        assert s.recv(1) == b"!"  # the child is up (its start is not timed)
        got, dt = _timed_recv(s, view)
    sender.wait(60)
    srv.close()
    src.unlink()
    assert got == total
    return dt


_SENDFILE_CHILD = """
import os, socket, sys
srv = socket.socket(fileno=int(sys.argv[1]))
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn.sendall(b"!")
fd = os.open(sys.argv[2], os.O_RDONLY)
total, off = os.fstat(fd).st_size, 0
while off < total:
    off += os.sendfile(conn.fileno(), fd, off, total - off)
conn.close()
"""


def bare_tls(payloads: list[bytes], work: Path) -> float:
    """The same bytes over TLS (Python's ssl, the default context: TLS 1.3, AES-GCM), sender
    and reader threads as in bare TCP: what a block port under TLS could reach at best."""
    cert, key = _self_signed(work)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=cert)
    total = sum(len(p) for p in payloads)
    srv = socket.create_server(("127.0.0.1", 0))

    def send() -> None:
        conn, _ = srv.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            for p in payloads:
                tls.sendall(p)

    t = threading.Thread(target=send)
    t.start()
    view = memoryview(bytearray(total))
    with client_ctx.wrap_socket(socket.create_connection(srv.getsockname()),
                                server_hostname="localhost") as s:
        s.do_handshake()
        got, dt = _timed_recv(s, view)
    t.join()
    srv.close()
    assert got == total
    return dt


def _self_signed(work: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    cert_path, key_path = work / "bench-tls.pem", work / "bench-tls.key"
    if cert_path.exists():
        return str(cert_path), str(key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)
