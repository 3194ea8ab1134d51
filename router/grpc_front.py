"""kv-router's gRPC ``Generate`` front door: the engines' own API (kvcache.v1.Generate), routed
like the HTTP requests. Runs on the router's event loop (grpc.aio) beside the HTTP server.

A request is parsed once (bad bytes: INVALID_ARGUMENT), its prompt tokenized and hashed once,
and sent to the chosen engine's Generate; an engine that is UNAVAILABLE before its first
response is taken out and the request tried on another. Other errors are the engine's answer
and go back to the caller with their code and message. The last response's cached-token counts
are the engine's report for the prediction's truth.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from router.service import Router
from rpc.listen import EXCLUSIVE_PORT, add_port

log = logging.getLogger("kv-router")

GENERATE_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


class GenerateFront:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._stubs: dict[str, generate_pb2_grpc.GenerateStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_stream_rpc_method_handler(
            self.Generate, request_deserializer=None,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(GENERATE_SERVICE, {"Generate": method})

    def _stub(self, target: str) -> generate_pb2_grpc.GenerateStub:
        stub = self._stubs.get(target)
        if stub is None:
            channel = grpc.aio.insecure_channel(target)
            self._channels.append(channel)
            stub = self._stubs[target] = generate_pb2_grpc.GenerateStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close(None)

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            request = generate_pb2.GenerateRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"not a valid {generate_pb2.GenerateRequest.DESCRIPTOR.full_name}: {exc}")
        r = self.router
        kind = request.WhichOneof("prompt")
        hashes = await r.off_loop(lambda: r.hashes(r.encode(request.text) if kind == "text"
                                                   else list(request.token_ids.ids)),
                                  len(request.text) if kind == "text" else len(request.token_ids.ids))
        tried: set[str] = set()
        errors: list[str] = []
        for _attempt in range(r.config.max_attempts):
            decision = r.decide(hashes, tried, grpc=True)
            if decision is None:
                break
            engine = decision.engine
            tried.add(engine.name)
            entry = r.record(decision)
            engine.begin(entry["request_id"], hashes, decision.gpu_blocks)
            call = self._stub(engine.spec.grpc).Generate(request, timeout=r.config.request_timeout_s)
            sent = False
            try:
                last = None
                async for msg in call:
                    if not sent:
                        engine.first_token(entry["request_id"])
                    sent = True
                    last = msg
                    yield msg
                if last is not None:
                    r.report(engine, entry, hashes, last.num_prompt_tokens, last.num_gpu_cached_tokens,
                             last.num_cpu_cached_tokens)
                return
            except grpc.aio.AioRpcError as exc:
                if sent or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    await context.abort(exc.code(), exc.details() or "")
                engine.take_out(f"Generate: {exc.code().name}: {exc.details()}")
                errors.append(f"{engine.name}: {exc.details()}")
                entry["reason"] += " (failed, retried)"
                r.retries += 1
            finally:
                engine.end(entry["request_id"])
                call.cancel()
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            "no engine could take the request: " + ("; ".join(errors) or "no engine is in rotation"))


async def start_grpc(router: Router, host: str, port: int) -> tuple[grpc.aio.Server, GenerateFront]:
    front = GenerateFront(router)
    server = grpc.aio.server(options=[EXCLUSIVE_PORT])
    server.add_generic_rpc_handlers((front.handler(),))
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # not in its stubs
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", GENERATE_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    bound = add_port(server, f"{host}:{port}")
    await server.start()
    log.info("gRPC Generate on port %d", bound)
    return server, front
