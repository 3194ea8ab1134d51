"""Binding a gRPC server's port with an error a person can act on.

grpcio raises a bare ``RuntimeError("Failed to bind to address ...")`` (older versions returned
port 0) whether the port is taken, the address is not local, or TLS credentials do not load; the
callers turn :class:`ListenError` (an ``OSError``) into one line and a non-zero exit.
"""

from __future__ import annotations

from typing import Protocol

import grpc

# gRPC servers bind with SO_REUSEPORT by default: a second server on a port already served binds
# without error and the kernel splits new connections between the two (seen when two stacks
# started at once: an engine's requests reached the other stack's engine). Every server of ours
# passes this option so that a taken port is an error.
EXCLUSIVE_PORT: tuple[str, int] = ("grpc.so_reuseport", 0)


class ListenError(OSError):
    """The port could not be bound; the message names the address and the likely causes."""


class _Server(Protocol):
    def add_insecure_port(self, address: str) -> int: ...
    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int: ...


def add_port(server: _Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind ``address`` (TLS with ``credentials``) on a sync or aio server; the bound port."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError:
        port = 0
    if port == 0:
        why = "the port is in use or the address is not one of this host's"
        if credentials is not None:
            why += ", or the TLS certificate and key do not load as a pair"
        raise ListenError(f"cannot listen on {address}: {why}")
    return port
