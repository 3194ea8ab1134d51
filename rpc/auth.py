"""Bearer-token authentication of gRPC calls (server side), for grpc.aio and sync servers.

Every call must carry ``authorization: Bearer <token>``; the token is compared in constant time
(``hmac.compare_digest``). A missing or wrong token is answered with ``UNAUTHENTICATED`` and a
message saying which. ``grpc.health.v1.Health`` stays open so probes (kubelet, compose, the
stack launcher) need no secret; it reveals only SERVING/NOT_SERVING. Server reflection is not
exempt: it describes the API, which is nobody's business without a token.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from rpc.tls import RpcConfigError

OPEN_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
"""Methods callable without a token."""

MISSING = "missing bearer token: send the metadata 'authorization: Bearer <token>'"
WRONG = "invalid bearer token"


class TokenCheck:
    """Decides whether a call's metadata carries the token; shared by both interceptors."""

    def __init__(self, token: str) -> None:
        if not token:
            raise RpcConfigError("the bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def refusal(self, details: grpc.HandlerCallDetails) -> str | None:
        """None when the call may proceed, else the UNAUTHENTICATED message."""
        if details.method.startswith(OPEN_PREFIXES):
            return None
        values = [v for k, v in (details.invocation_metadata or ()) if k == "authorization"]
        if not values:
            return MISSING
        got = values[0] if isinstance(values[0], bytes) else str(values[0]).encode()
        # compare_digest: the time taken must not tell how much of a guess was right.
        return None if len(values) == 1 and hmac.compare_digest(got, self._expected) else WRONG


def _denying_handler(handler: grpc.RpcMethodHandler, message: str, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call with ``message``."""
    code = grpc.StatusCode.UNAUTHENTICATED
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if aio:
        async def unary(_req: Any, ctx: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await ctx.abort(code, message)

        async def stream(_req: Any, ctx: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await ctx.abort(code, message)
            yield None  # unreachable: abort raises; makes this an async generator
    else:
        def unary(_req: Any, ctx: grpc.ServicerContext) -> Any:  # type: ignore[misc]
            ctx.abort(code, message)

        def stream(_req: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:  # type: ignore[misc]
            ctx.abort(code, message)
            yield None  # unreachable: abort raises; makes this a generator
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """For grpc.aio servers (offloadd)."""

    def __init__(self, token: str) -> None:
        self.check = TokenCheck(token)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        refusal = self.check.refusal(handler_call_details)
        if refusal is None or handler is None:
            return handler
        return _denying_handler(handler, refusal, aio=True)


class SyncTokenInterceptor(grpc.ServerInterceptor):
    """For thread-pool servers (the engine's Generate server)."""

    def __init__(self, token: str) -> None:
        self.check = TokenCheck(token)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        refusal = self.check.refusal(handler_call_details)
        if refusal is None or handler is None:
            return handler
        return _denying_handler(handler, refusal, aio=False)
