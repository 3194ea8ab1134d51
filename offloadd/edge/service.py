"""Thin gRPC servicers: bytes -> proto -> domain -> proto, and domain errors -> status codes.

Handlers take raw bytes and parse them here so that garbage gets INVALID_ARGUMENT with a
message (grpc's own deserializer would answer INTERNAL); offloadd.codec converts the rest.
Error mapping: InvalidArgument and SchemaError -> INVALID_ARGUMENT; FailedPrecondition ->
FAILED_PRECONDITION (NotRegistered with the ``kvd-error: not-registered`` trailer); NotFound ->
NOT_FOUND; ResourceExhausted -> RESOURCE_EXHAUSTED; RedisUnavailable -> UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError, Message
from kvcache.v1 import events_pb2, log_pb2, offload_pb2

from events.codec_proto import record_to_proto, snapshot_to_proto
from events.schema import SchemaError
from offloadd import codec
from offloadd.edge.batch_bulk import batch_from_wire
from offloadd.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RequestError,
    ResourceExhausted,
)
from offloadd.log.ingest import Ack, Ingest
from offloadd.log.liveness import Liveness
from offloadd.log.metadata import LogConflict, MetadataStore, RedisUnavailable
from offloadd.metrics import DaemonMetrics
from offloadd.tier.registration import Registrar
from offloadd.tier.source import DAEMON_SOURCE
from offloadd.tier.store import HostStore
from offloadd.tier.writes import StoreWriter

if TYPE_CHECKING:  # imported only when peers are configured (offloadd.edge.server)
    from offloadd.fleet.fill import FleetFill

log = logging.getLogger(__name__)

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (SchemaError, grpc.StatusCode.INVALID_ARGUMENT),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RedisUnavailable, grpc.StatusCode.UNAVAILABLE),
    (LogConflict, grpc.StatusCode.INTERNAL),
]
Context = grpc.aio.ServicerContext[Any, Any]
ENGINE_ID_HEADER = "kvd-engine-id"  # Publish metadata: the engine whose liveness the stream is
PUBLISH_WINDOW = 64  # batches of one Publish stream submitted ahead of their acks
# What a Publish stream answers, in order: an ack already made, or a batch and its future ack
_Answer = Message | tuple[events_pb2.EventBatch, "asyncio.Future[Ack]"]


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return None


def parse(raw: bytes, cls: type[Message], what: str) -> Any:
    try:
        return cls.FromString(raw)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidArgument(f"{what}: not a valid {cls.DESCRIPTOR.full_name}: {exc}") from exc


class Servicers:
    def __init__(
        self, store: HostStore, writer: StoreWriter, ingest: Ingest, metadata: MetadataStore,
        metrics: DaemonMetrics, on_fatal: Callable[[str], None], liveness: Liveness,
        fleet: FleetFill | None = None,
    ) -> None:
        self.store = store
        self.registrar = Registrar(store)
        self.writer = writer
        self.ingest = ingest
        self.metadata = metadata
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.liveness = liveness
        self.fleet = fleet  # fills local misses from peers' tiers before Lookup answers
        self.stopping = asyncio.Event()  # set by stop(): long-lived streams answer and return
        self._reading: set[asyncio.Task[Any]] = set()  # Publish streams waiting for a batch

    def stop(self) -> None:
        """End the long-lived streams (Publish, follow-Subscribe) after their current message."""
        self.stopping.set()
        for task in list(self._reading):
            task.cancel()

    async def _unary(
        self, name: str, req_cls: type[Message], raw: bytes, context: Context,
        fn: Callable[[Any], Awaitable[Message]],
    ) -> Message:
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await fn(parse(raw, req_cls, name))
        except (RequestError, SchemaError, RedisUnavailable, LogConflict) as exc:
            code = status_of(exc) or grpc.StatusCode.UNKNOWN
            if isinstance(exc, LogConflict):
                self.on_fatal(str(exc))
            await _abort(context, code, f"{name}: {exc}", exc)
            raise  # abort raises; this is for type checkers
        finally:
            self.metrics.rpc_latency.labels(name, code.name).observe(time.perf_counter() - t0)

    def handlers(self) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
        def unary(name: str, req: type[Message], resp: type[Message],
                  fn: Callable[[Any], Awaitable[Message]]) -> grpc.RpcMethodHandler:
            async def behavior(raw: bytes, context: Context) -> Message:
                return await self._unary(name, req, raw, context, fn)
            return grpc.unary_unary_rpc_method_handler(
                behavior, response_serializer=resp.SerializeToString
            )

        o = offload_pb2
        return {
            "kvcache.v1.OffloadStore": {
                "RegisterEngine": unary("RegisterEngine", o.RegisterEngineRequest,
                                        o.RegisterEngineResponse, self.register_engine),
                "Lookup": unary("Lookup", o.LookupRequest, o.LookupResponse, self.lookup),
                "Reserve": unary("Reserve", o.ReserveRequest, o.ReserveResponse, self.reserve),
                "Commit": unary("Commit", o.CommitRequest, o.CommitResponse, self.commit),
                "Abort": unary("Abort", o.AbortRequest, o.AbortResponse, self.abort),
                "Release": unary("Release", o.ReleaseRequest, o.ReleaseResponse, self.release),
                "Stats": unary("Stats", o.StatsRequest, o.StatsResponse, self.stats),
                "ReadBlocks": grpc.unary_stream_rpc_method_handler(
                    self.read_blocks, response_serializer=bytes),  # codec.block_data_wire
            },
            "kvcache.v1.EventIngest": {
                "Publish": grpc.stream_stream_rpc_method_handler(
                    self.publish, response_serializer=log_pb2.PublishAck.SerializeToString),
            },
            "kvcache.v1.EventLog": {
                "Subscribe": grpc.unary_stream_rpc_method_handler(
                    self.subscribe, response_serializer=events_pb2.LogRecord.SerializeToString),
                "Snapshot": unary("Snapshot", log_pb2.SnapshotRequest, log_pb2.SnapshotResponse,
                                  self.snapshot),
            },
        }

    # -- OffloadStore ---------------------------------------------------------------------

    async def register_engine(self, req: offload_pb2.RegisterEngineRequest) -> Message:
        infos = await self.registrar.register(
            req.engine_id, req.incarnation, req.model_namespace, codec.groups_from_proto(req)
        )
        return codec.registration_to_proto(infos, self.store.config.hash_algo)

    async def lookup(self, req: offload_pb2.LookupRequest) -> Message:
        queries = codec.queries_from_proto(req)
        if self.fleet is not None:
            await self.fleet.fill(req.engine_id, queries)
        return codec.lookup_to_proto(self.store.lookup(req.engine_id, queries, req.pin, req.lease_ms))

    async def reserve(self, req: offload_pb2.ReserveRequest) -> Message:
        out = await self.writer.reserve(
            req.engine_id, req.group_idx, codec.blocks_from_proto(req), req.lease_ms,
            req.lora_name or None,
        )
        return codec.reserve_to_proto(out)

    async def commit(self, req: offload_pb2.CommitRequest) -> Message:
        out = await self.writer.commit(req.engine_id, req.reservation_id, list(req.block_hashes))
        return codec.commit_to_proto(out)

    async def abort(self, req: offload_pb2.AbortRequest) -> Message:
        return codec.abort_to_proto(self.writer.abort(req.engine_id, req.reservation_id))

    async def release(self, req: offload_pb2.ReleaseRequest) -> Message:
        return codec.release_to_proto(self.store.release(req.engine_id, req.lease_id))

    async def stats(self, req: offload_pb2.StatsRequest) -> Message:
        return codec.stats_to_proto(self.store.stats())

    async def read_blocks(self, raw: bytes, context: Context) -> AsyncIterator[bytes]:
        try:
            req = parse(raw, offload_pb2.ReadBlocksRequest, "ReadBlocks")
            blocks = self.store.read_blocks(req.engine_id, req.group_idx, list(req.block_hashes))
        except RequestError as exc:
            await _abort(context, status_of(exc) or grpc.StatusCode.UNKNOWN, f"ReadBlocks: {exc}", exc)
            return
        for block in blocks:
            yield codec.block_data_wire(block)

    # -- EventIngest ----------------------------------------------------------------------

    async def publish(self, requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[Message]:
        """The stream is its engines' liveness (offloadd.log.liveness). An engine that leaves
        says so with a last ``departing`` batch: its GPU tier is cleared at once. A stream that
        ends without it (cancelled, aborted, a half-close after a crash of the sender: the daemon
        cannot tell these apart reliably) is broken: cleared after the engine lease unless the
        engine comes back. On the daemon's own stop it returns and says nothing.

        Batches are pipelined: one reader task per stream fences and hands each batch to the
        log as it arrives (``Ingest.submit``), up to PUBLISH_WINDOW ahead of the answers, so
        the batches of a stream share Redis writes; this generator answers them in order, each
        once it is durable (the acks are those of handling them one at a time). The reader,
        while it waits for a batch, is in ``_reading``: ``stop()`` cancels it; the batches it
        submitted are answered, then the stream returns."""
        engines: set[str] = set()
        departed: set[str] = set()
        header = dict(context.invocation_metadata() or ()).get(ENGINE_ID_HEADER)
        if isinstance(header, str):
            self._bind(engines, header)
        answers: asyncio.Queue[_Answer | None] = asyncio.Queue(PUBLISH_WINDOW)
        reader = asyncio.ensure_future(self._read_batches(requests, engines, departed, answers))
        try:
            while (answer := await answers.get()) is not None:
                if isinstance(answer, Message):
                    yield answer
                    continue
                msg, acked = answer
                try:
                    ack = await acked
                except (InvalidArgument, RedisUnavailable, LogConflict) as exc:
                    await self._abort_publish(context, exc)
                    return
                yield self._ack_to_proto(msg, ack)
        finally:
            reader.cancel()
            stopping = self.stopping.is_set()
            for engine_id in engines:
                self.liveness.closed(engine_id, engine_id in departed and not stopping)

    async def _read_batches(
        self, requests: AsyncIterator[bytes], engines: set[str], departed: set[str],
        answers: asyncio.Queue[_Answer | None],
    ) -> None:
        """Read, fence and submit the stream's batches in order; ``None`` after the last. An
        error ends the stream after the answers before it (a failed future carries it)."""
        task = asyncio.current_task()
        try:
            while not self.stopping.is_set():
                if task is not None:
                    self._reading.add(task)
                try:
                    raw = await anext(requests)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if self.stopping.is_set():
                        break  # stop() woke us: the engine did not depart
                    raise
                finally:
                    self._reading.discard(task)  # type: ignore[arg-type]
                msg = parse(raw, events_pb2.EventBatch, "Publish")
                self._bind(engines, msg.engine_id)
                if msg.departing:
                    departed.add(msg.engine_id)  # no answer: the sender half-closes next
                    continue
                await answers.put(await self._submit(raw, msg))  # waits while the window is full
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failed: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            failed.add_done_callback(_retrieved)
            await answers.put((events_pb2.EventBatch(), failed))
        await answers.put(None)

    def _bind(self, engines: set[str], engine_id: str) -> None:
        if engine_id and engine_id != DAEMON_SOURCE and engine_id not in engines:
            engines.add(engine_id)
            self.liveness.opened(engine_id)

    async def _submit(self, raw: bytes, msg: events_pb2.EventBatch) -> _Answer:
        try:
            batch = batch_from_wire(raw, msg)
        except SchemaError as exc:
            self.ingest.num_rejected += 1
            return log_pb2.PublishAck(engine_id=msg.engine_id, incarnation=msg.incarnation,
                                      seq=msg.seq, status=log_pb2.PublishAck.STATUS_REJECTED,
                                      message=f"malformed batch: {exc}")
        acked = await self.ingest.submit(batch)
        acked.add_done_callback(_retrieved)  # a stream gone before its ack must not leak it
        return msg, acked

    async def _abort_publish(self, context: Context, exc: Exception) -> None:
        if isinstance(exc, InvalidArgument):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        elif isinstance(exc, RedisUnavailable):
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"Publish: {exc}; keep the batch and resend after reconnecting")
        else:
            self.on_fatal(str(exc))
            await context.abort(grpc.StatusCode.INTERNAL, f"Publish: {exc}")

    def _ack_to_proto(self, msg: events_pb2.EventBatch, ack: Ack) -> Message:
        if ack.status == 1 and msg.ts > 0:
            self.metrics.ingest_lag.observe(max(0.0, time.time() - msg.ts))
        return log_pb2.PublishAck(
            engine_id=msg.engine_id, incarnation=msg.incarnation, seq=msg.seq,
            status=int(ack.status), acked_seq=ack.acked_seq,  # type: ignore[arg-type]
            resend_from=ack.resend_from, log_offset=ack.log_offset, message=ack.message,
            log_epoch=ack.log_epoch,
        )

    # -- EventLog -------------------------------------------------------------------------

    async def subscribe(self, raw: bytes, context: Context) -> AsyncIterator[Message]:
        try:
            req = parse(raw, log_pb2.SubscribeRequest, "Subscribe")
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        start = max(1, req.from_offset)
        while True:
            waiter = self.metadata.next_append()  # taken before reading: no lost wake-up
            try:
                records = await self.metadata.read_range(start, 512)
            except RedisUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"Subscribe: {exc}")
                return
            for record in records:
                yield record_to_proto(record)
                start = record.offset + 1
            if req.follow and self.stopping.is_set():
                return  # the daemon stops: a follower reconnects to the next one
            if records:
                continue
            if not req.follow:
                return
            await _wait_either(waiter, self.stopping, 1.0)

    async def snapshot(self, req: log_pb2.SnapshotRequest) -> Message:
        return snapshot_to_proto(self.metadata.state.export())


def _retrieved(future: asyncio.Future[Ack]) -> None:
    """Mark an ack's error as seen: a Publish stream that ended (the engine gave up, a Redis
    failover) leaves the acks of its batches in flight unawaited, and asyncio would report
    each failed one as "Future exception was never retrieved". The stream's own await still
    raises it."""
    if not future.cancelled():
        future.exception()


async def _abort(context: Context, code: grpc.StatusCode, details: str, exc: BaseException) -> None:
    """End the call with ``code``; request errors of a finer kind than the code say so in a
    trailer (offloadd.codec.error_trailers) that clients turn into a typed error."""
    trailers = codec.error_trailers(exc) if isinstance(exc, RequestError) else ()
    await context.abort(code, details, trailing_metadata=trailers)


async def _wait_either(a: asyncio.Event, b: asyncio.Event, timeout_s: float) -> None:
    """Until ``a`` or ``b`` is set, at most ``timeout_s``."""
    waits = (asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
