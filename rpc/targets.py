"""A gRPC target given on a command line, checked before a process starts on it.

grpcio takes a malformed target (``host::``, ``:50051``, ``host:port`` with a word for the port)
and retries resolving it forever; a flag with a typo then looks like a peer that is down. Only
the plain ``HOST:PORT`` form is checked; targets with a gRPC scheme (``unix:``, ``dns:``,
``ipv4:`` ...) pass as they are.
"""

from __future__ import annotations

_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:", "xds:")


class TargetError(ValueError):
    """The target cannot be a gRPC address; the message says why and shows the form."""


def check_grpc_target(target: str, what: str = "target") -> str:
    """``target`` unchanged when it can be a gRPC address, else :class:`TargetError`."""
    if target.startswith(_SCHEMES):
        return target
    form = "expected HOST:PORT, [IPV6]:PORT or unix:PATH"
    host, sep, port = target.rpartition(":")
    if not sep or not host or any(c.isspace() for c in target):
        raise TargetError(f"{what} {target!r}: {form}")
    bracketed = host.startswith("[") and host.endswith("]")
    if ":" in host and not bracketed:
        raise TargetError(f"{what} {target!r}: {form} (an IPv6 address goes in brackets)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise TargetError(f"{what} {target!r}: the port must be a number in 1..65535")
    return target
