"""Errors the client raises: the daemon's answer as a typed exception, under the package root.

:func:`error_from_rpc` turns a failed call into the most specific class: network-class codes
become :class:`OffloadUnavailable`, the ``not-registered`` marker (offloadd.codec) becomes
:class:`NotRegistered`, anything else :class:`OffloadClientError` with its code.
"""

from __future__ import annotations

import grpc

from offloadd.codec import NOT_REGISTERED, error_kind
from offloadd.errors import OffloaddError
from rpc.retry import NETWORK_READ_CODES


class OffloadClientError(OffloaddError):
    """The daemon refused a call; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class OffloadUnavailable(OffloadClientError):
    """The daemon (or its Redis) stayed unreachable through every retry."""


class NotRegistered(OffloadClientError):
    """The daemon does not know this engine id (FAILED_PRECONDITION): register again."""


def error_from_rpc(exc: grpc.RpcError) -> OffloadClientError:
    code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
    details = exc.details() or ""  # type: ignore[attr-defined]
    if code in NETWORK_READ_CODES:
        return OffloadUnavailable(code, details)
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    if error_kind(trailers) == NOT_REGISTERED:
        return NotRegistered(code, details)
    return OffloadClientError(code, details)
