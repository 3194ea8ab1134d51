"""gRPC edge of the engine: the ``Generate`` service (tokens streamed back), health, reflection.

The servicer only converts proto <-> domain; the EngineLoop does the work. Bad input is
answered with INVALID_ARGUMENT and the engine's message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvcache.v1 import generate_pb2

from engine.engine_loop import EngineLoop
from engine.errors import EngineError, EngineStopped, InvalidRequest
from engine.sampling import SamplingParams
from rpc.auth import SyncTokenInterceptor
from rpc.listen import EXCLUSIVE_PORT, add_port

log = logging.getLogger(__name__)

GENERATE_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


def sampling_from_proto(msg: generate_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults mean 'unset': max_tokens 0 -> engine default, top_p 0 -> 1, temperature 0
    -> greedy."""
    return SamplingParams(
        max_tokens=msg.max_tokens or None,
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


class GenerateServicer:
    """Takes the request as raw bytes and parses it itself, so that bytes that are not a
    GenerateRequest get INVALID_ARGUMENT with a message (grpc's own parser answers INTERNAL)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_stream_rpc_method_handler(
            self.Generate, request_deserializer=None,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(GENERATE_SERVICE, {"Generate": method})

    def Generate(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[generate_pb2.GenerateResponse]:
        try:
            request = generate_pb2.GenerateRequest.FromString(raw)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"not a valid {generate_pb2.GenerateRequest.DESCRIPTOR.full_name}: {exc}")
        kind = request.WhichOneof("prompt")
        prompt: str | list[int] = (
            request.text if kind == "text" else list(request.token_ids.ids) if kind == "token_ids" else []
        )
        try:
            stream = self.loop.submit(prompt, sampling_from_proto(request.sampling), request.request_id or None)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        rid = stream.request_id
        context.add_callback(lambda: self.loop.abort(rid))
        try:
            for out in stream:
                yield generate_pb2.GenerateResponse(
                    request_id=rid,
                    token_ids=out.new_token_ids,
                    text=out.new_text,
                    finished=out.finished,
                    finish_reason=out.finish_reason or "",
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_gpu_cached_tokens=out.num_cached_tokens,
                    num_cpu_cached_tokens=out.num_external_cached_tokens,
                )
        except EngineStopped as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineError as exc:
            context.abort(grpc.StatusCode.INTERNAL, str(exc))


def create_server(
    loop: EngineLoop, address: str = "[::]:0", max_workers: int = 32, *,
    credentials: grpc.ServerCredentials | None = None, token: str | None = None,
) -> tuple[grpc.Server, int]:
    """A started-ready (not started) server with Generate, health and reflection; and its port.

    ``credentials`` (rpc.tls.server_credentials) serve TLS or mutual TLS; with ``token``
    every call but health must carry ``authorization: Bearer <token>`` (rpc.auth)."""
    interceptors: list[grpc.ServerInterceptor[Any, Any]] | None = (
        [SyncTokenInterceptor(token)] if token is not None else None)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         interceptors=interceptors, options=[EXCLUSIVE_PORT])
    server.add_generic_rpc_handlers((GenerateServicer(loop).handler(),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", GENERATE_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (GENERATE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return server, add_port(server, address, credentials)
