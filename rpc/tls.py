"""TLS material and channel building for every gRPC edge of kvoffload (daemon, engine, probes).

Server side: :func:`server_credentials` (TLS, or mutual TLS when a client CA is given).
Client side: :class:`ClientSecurity` bundles channel credentials and a bearer token and opens
sync or asyncio channels; the engine, the stack's probes and the tests all build channels
through it, so one set of flags means the same thing everywhere.

The bearer token is attached by a client interceptor rather than by
``grpc.access_token_call_credentials``: call credentials are only sent over a secure channel,
and a token over a unix socket or the loopback interface (no TLS) is a supported deployment.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


class RpcConfigError(ValueError):
    """The root of rpc's errors: gRPC plumbing asked to run with settings it cannot use."""


class SecurityConfigError(RpcConfigError):
    """A certificate, key or token file is missing, unreadable or empty; the message names it."""


def read_file(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{what} {path!r}: {exc.strerror or exc}") from exc
    if not data.strip():
        raise SecurityConfigError(f"{what} {path!r} is empty")
    return data


def read_pem(path: str, what: str) -> bytes:
    """A certificate, key or CA bundle file; refused unless it holds a PEM block (gRPC would
    only fail later, at bind or connect, with a message that names neither file)."""
    data = read_file(path, what)
    if b"-----BEGIN " not in data:
        raise SecurityConfigError(f"{what} {path!r} is not PEM (no '-----BEGIN ...' block)")
    return data


def read_token(path: str, *, warn: bool = True) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); refused if empty. A file
    every user may read gets a warning, not a refusal: Kubernetes mounts secrets 0644 by
    default, where "every user" is the container's own."""
    raw = read_file(path, "token file")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise SecurityConfigError(f"token file {path!r}: the token must be ASCII") from exc
    if any(c.isspace() or not c.isprintable() for c in token):
        raise SecurityConfigError(f"token file {path!r}: the token must be one line without spaces")
    if warn and os.stat(path).st_mode & stat.S_IROTH:
        log.warning("token file %s is readable by every user; chmod 600 (or 640 with a group) it "
                    "unless only trusted users can log in here", path)
    return token


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials:
    """TLS server credentials; with ``client_ca_file`` every client must present a certificate
    signed by that CA (mutual TLS)."""
    if not cert_file or not key_file:
        raise SecurityConfigError("TLS needs both a certificate file and a key file")
    cert = read_pem(cert_file, "TLS certificate")
    key = read_pem(key_file, "TLS key")
    if not client_ca_file:
        return grpc.ssl_server_credentials([(key, cert)])
    ca = read_pem(client_ca_file, "client CA")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def check_server_tls(cert_file: str, key_file: str, client_ca_file: str) -> None:
    """Refuse half-configured TLS (a key without a certificate, a client CA without TLS)."""
    if bool(cert_file) != bool(key_file):
        raise SecurityConfigError("TLS needs both a certificate file and a key file (got only one)")
    if client_ca_file and not cert_file:
        raise SecurityConfigError("a client CA (mutual TLS) needs a TLS certificate and key as well")


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a sync channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), self._header),
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails,
                               request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails,
                               request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _AioToken:
    """Base of the asyncio interceptors. grpc.aio files an interceptor under the first call kind
    it implements only, so each kind needs its own object (see :func:`_aio_interceptors`)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def _aio_interceptors(token: str) -> list[_AioToken]:
    return [cls(token) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


# gRPC's default reconnect backoff starts at 1 s and grows by 1.6x to 120 s: an engine whose
# daemon was down for a minute would wait up to two more before it noticed the daemon back (and
# its ingest stream, queue filling, would reset meanwhile). Our peers are on the same node or
# close: retry within 0.25 s at first, never wait more than 2 s. A caller's options win.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def _with_reconnect(options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    given = {name for name, _ in options}
    return [*(o for o in RECONNECT_OPTIONS if o[0] not in given), *options]


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a gRPC server: plaintext or TLS (``credentials``), with or without
    a bearer token. The default is plaintext without a token (loopback and unix sockets)."""

    credentials: grpc.ChannelCredentials | None = None
    token: str | None = None

    @classmethod
    def from_files(cls, ca_file: str = "", cert_file: str = "", key_file: str = "",
                   token_file: str = "") -> ClientSecurity:
        """``ca_file`` turns TLS on (the server's certificate must chain to it; empty CA with a
        client certificate uses the system roots); ``cert_file``/``key_file`` present a client
        certificate (mutual TLS); ``token_file`` holds the bearer token."""
        if bool(cert_file) != bool(key_file):
            raise SecurityConfigError("a client certificate needs both --*-cert and --*-key")
        credentials = None
        if ca_file or cert_file:
            ca = read_pem(ca_file, "CA certificate") if ca_file else None
            key = read_pem(key_file, "client key") if key_file else None
            cert = read_pem(cert_file, "client certificate") if cert_file else None
            credentials = grpc.ssl_channel_credentials(ca, key, cert)
        return cls(credentials, read_token(token_file) if token_file else None)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        options = _with_reconnect(options)
        if self.credentials is None:
            channel = grpc.insecure_channel(target, options=options)
        else:
            channel = grpc.secure_channel(target, self.credentials, options=options)
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, _TokenInterceptor(self.token))

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        # The stubs type interceptors loosely (a protocol they ask to cast to): Any it is.
        interceptors: Any = _aio_interceptors(self.token) if self.token is not None else None
        options = _with_reconnect(options)
        if self.credentials is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(target, self.credentials, options=options,
                                       interceptors=interceptors)

    def __repr__(self) -> str:  # never print the token
        return f"ClientSecurity(tls={self.credentials is not None}, token={'***' if self.token else None})"
