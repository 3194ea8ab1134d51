"""Checkpoint exports forked back to back while a gRPC server in the same loop answers calls
from clients in that loop, as in the daemon: ``python -m tests.offloadd.export_under_grpc N``
prints ``{"exports": N, "failed": [...], "calls": ..., "grpc_fork_support": ...}`` as JSON.

It imports offloadd before grpc, as the daemon's entry points do, so gRPC loads with the
daemon's settings (offloadd/__init__); an explicit GRPC_ENABLE_FORK_SUPPORT in the environment
wins, so the test can show what the setting prevents.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from events.checkpoint import Manifest, decode_snapshot
from events.checkpoint_cut import Cuts, fences
from events.checkpoint_delta import tails
from events.schema import BlockStored, LogRecord
from events.state import CacheState
from offloadd.log.forked_export import ExportFailed, export_pieces


def _state(n: int) -> CacheState:
    state = CacheState()
    for i in range(1, n + 1):
        state.apply(LogRecord(i, "engine-a", 1, i, 0.0, (BlockStored((i,), None, (1, 2), 2, "GPU"),)))
    return state


async def _run(num_exports: int) -> dict[str, object]:
    import grpc  # after offloadd (above): the daemon's gRPC settings
    from grpc_health.v1 import _async as health_aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    calls = 0
    stop = asyncio.Event()

    async def client() -> None:
        nonlocal calls
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                await stub.Check(health_pb2.HealthCheckRequest())
                calls += 1

    clients = [asyncio.create_task(client()) for _ in range(4)]
    while calls < 20:  # traffic flowing before the first fork
        await asyncio.sleep(0.01)
    state, failed, wrong = _state(2000), [], 0
    want = CacheState.from_snapshot(state.export())
    for i in range(num_exports):
        try:
            parts = tails(state, {}, set(), copy=False)
            chunks = [c async for c in export_pieces(parts, Cuts(500, 1, 500), {}, set())]
        except ExportFailed as exc:
            failed.append(f"export {i}: {exc}")
            continue
        manifest = Manifest("x", want.offset, "e", 0.0, (0,), 0, 2, tuple(c.address for c in chunks),
                            fences(state))
        wrong += CacheState.from_snapshot(decode_snapshot(manifest, [c.data for c in chunks])) != want
    stop.set()
    await asyncio.gather(*clients)
    await server.stop(1.0)
    return {"exports": num_exports, "failed": failed, "wrong": wrong, "calls": calls,
            "grpc_fork_support": os.environ.get("GRPC_ENABLE_FORK_SUPPORT")}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_run(int(sys.argv[1])))))
