"""The orderly stop of ``kv-engine serve`` (SIGTERM, SIGINT), every step bounded, in the order
that loses nothing:

1. both front doors (gRPC, HTTP) stop taking requests at once; requests in flight get
   ``grace_s`` to finish;
2. the engine loop stops after its current step and ends every request still open with
   EngineStopped, which the front doors answer as such (gRPC UNAVAILABLE, HTTP 503 or an error
   event in the stream); the servers' own deadline comes ``SERVER_MARGIN_S`` later, so they
   cancel nothing themselves unless a handler hangs;
3. the offload connector finishes the stores it queued to offloadd and releases its pins;
4. the event sink waits for offloadd to ack every event batch (none come once the loop
   stopped), then departs (the daemon clears this engine's GPU tier at once).

Last, ``gc.freeze()``: the interpreter's exit runs several full collections while it tears the
modules down, each over the few 100k objects that torch and the engine hold (1.5-3 s of CPU
for a tiny model on an idle host, far more on a busy one); frozen objects are not walked.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Final, Protocol

import grpc

from engine.engine_loop import EngineLoop
from engine.event_sink import EventSink
from rpc.http_server import ThreadedHttpServer

log = logging.getLogger(__name__)

SERVER_MARGIN_S: Final = 2.0
"""The servers' graceful deadline is the engine's grace plus this (ThreadedHttpServer's
``grace_s`` too): by then the engine loop has ended every request."""


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass
class Serving:
    """What ``kv-engine serve`` runs, to be stopped in order."""

    loop: EngineLoop
    grpc_server: grpc.Server
    http: ThreadedHttpServer | None
    connector: Closable | None
    sink: EventSink

    def shut_down(self, grace_s: float) -> None:
        t0 = time.monotonic()
        grpc_done = self.grpc_server.stop(grace=grace_s + SERVER_MARGIN_S)  # returns at once
        if self.http is not None:  # returns once no request is open, at most after grace_s
            self.http.stop(timeout_s=grace_s)
        grpc_done.wait(max(0.0, t0 + grace_s - time.monotonic()))
        t1 = time.monotonic()
        self.loop.stop()
        if self.http is not None:
            self.http.stop(timeout_s=SERVER_MARGIN_S + 1)
        grpc_done.wait(SERVER_MARGIN_S + 1)
        t2 = time.monotonic()
        if self.connector is not None:
            self.connector.close()
        t3 = time.monotonic()
        self.sink.close()
        t4 = time.monotonic()
        log.info("stopped in %.2f s (requests %.2f s, engine loop %.2f s, offload stores %.2f s, "
                 "event acks %.2f s)", t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        gc.freeze()
