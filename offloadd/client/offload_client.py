"""Typed clients of offloadd: the only way the engine (and tests) reach the daemon.

- :class:`OffloadClient` (sync) and :class:`AsyncOffloadClient` wrap OffloadStore and EventLog
  and return domain types (offloadd.messages, events.schema).
- :class:`ArenaMapping` (offloadd.arena) maps a group's arena files; get one from
  ``EngineRegistration.map_arena(group_idx)``.
- :class:`IngestStream` (offloadd.client.ingest_stream) publishes an engine's GPU-tier events.
Retries only on network-class errors (UNAVAILABLE; DEADLINE_EXCEEDED too for reads), with
exponential backoff. Everything else raises :class:`OffloadClientError` carrying the code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from kvcache.v1 import log_pb2, log_pb2_grpc, offload_pb2, offload_pb2_grpc

from events.codec_proto import record_from_proto, snapshot_from_proto
from events.schema import LogRecord
from events.state import Snapshot
from offloadd.arena import ArenaGeometry, ArenaMapping, SlotGenerations
from offloadd.client import codec
from offloadd.client.codec import BlockData, CommitOutcome, EngineRegistration
from offloadd.client.ingest_stream import IngestStream
from offloadd.messages import (
    BlockToStore,
    GroupArenaInfo,
    GroupHit,
    GroupQuery,
    GroupSpec,
    LookupOutcome,
    ReserveOutcome,
    ReserveStatus,
    StoreStats,
)
from rpc.tls import ClientSecurity

__all__ = [
    "ArenaGeometry", "ArenaMapping", "AsyncOffloadClient", "BlockData", "BlockToStore",
    "ClientSecurity", "CommitOutcome", "EngineRegistration", "GroupArenaInfo", "GroupHit",
    "GroupQuery", "GroupSpec", "IngestStream", "LookupFuture", "LookupOutcome", "OffloadClient",
    "OffloadClientError",
    "OffloadUnavailable", "ReserveOutcome", "ReserveStatus", "RetryPolicy", "SlotGenerations", "StoreStats",
]

T = TypeVar("T")
_NETWORK = frozenset({grpc.StatusCode.UNAVAILABLE})
_NETWORK_READ = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class OffloadClientError(Exception):
    """The daemon refused a call; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class OffloadUnavailable(OffloadClientError):
    """The daemon (or its Redis) stayed unreachable through every retry."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_backoff_s
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * self.multiplier, self.max_backoff_s)


def _error(exc: grpc.RpcError) -> OffloadClientError:
    code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
    details = exc.details() or ""  # type: ignore[attr-defined]
    cls = OffloadUnavailable if code in _NETWORK_READ else OffloadClientError
    return cls(code, details)


def _call_sync(fn: Callable[[], T], retry: RetryPolicy, retry_on: frozenset[grpc.StatusCode]) -> T:
    delays = retry.delays()
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() not in retry_on:  # type: ignore[attr-defined]
                raise _error(exc) from exc
            delay = next(delays, None)
            if delay is None:
                raise _error(exc) from exc
            time.sleep(delay)


async def _call_async(
    fn: Callable[[], Awaitable[T]], retry: RetryPolicy, retry_on: frozenset[grpc.StatusCode]
) -> T:
    delays = retry.delays()
    while True:
        try:
            return await fn()
        except grpc.RpcError as exc:
            if exc.code() not in retry_on:  # type: ignore[attr-defined]
                raise _error(exc) from exc
            delay = next(delays, None)
            if delay is None:
                raise _error(exc) from exc
            await asyncio.sleep(delay)


class LookupFuture:
    """A Lookup in flight (``OffloadClient.lookup_future``): not retried, since its caller
    falls back to asking again on any failure."""

    def __init__(self, future: concurrent.futures.Future[LookupOutcome]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> LookupOutcome:
        """The answer; raises OffloadClientError (OffloadUnavailable for network failures)."""
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise OffloadUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"no Lookup answer within {timeout} s") from exc


class OffloadClient:
    """Blocking client; ``target`` is ``host:port`` or ``unix:/path``. ``credentials`` (see
    rpc.tls.ClientSecurity.from_files) turn TLS on; ``token`` is sent as a bearer token."""

    def __init__(self, target: str, timeout_s: float = 5.0, retry: RetryPolicy | None = None, *,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None) -> None:
        self.channel = ClientSecurity(credentials, token).channel(target)
        self._store = offload_pb2_grpc.OffloadStoreStub(self.channel)
        self._log = log_pb2_grpc.EventLogStub(self.channel)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None

    def _do(self, method: Any, req: Any, read: bool = False) -> Any:
        return _call_sync(lambda: method(req, timeout=self.timeout_s), self.retry,
                          _NETWORK_READ if read else _NETWORK)

    def register_engine(self, engine_id: str, incarnation: int, model_namespace: str,
                        groups: Sequence[GroupSpec]) -> EngineRegistration:
        req = codec.register_request(engine_id, incarnation, model_namespace, groups)
        return codec.registration_from(self._do(self._store.RegisterEngine, req))

    def lookup(self, engine_id: str, queries: Sequence[GroupQuery], pin: bool = False,
               lease_ms: int = 0) -> LookupOutcome:
        req = codec.lookup_request(engine_id, queries, pin, lease_ms)
        return codec.lookup_from(self._do(self._store.Lookup, req, read=not pin))

    def lookup_future(self, engine_id: str, queries: Sequence[GroupQuery], pin: bool = False,
                      lease_ms: int = 0) -> LookupFuture:
        """``lookup`` without waiting for the answer: built, sent and parsed on this client's
        own sender thread. (gRPC's ``.future()`` starts a thread per call when none is in
        flight: 0.4-0.7 ms of the caller's time on an H200 host.)"""
        if self._sender is None:
            self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-lookup")
        return LookupFuture(self._sender.submit(self._lookup_once, engine_id, tuple(queries), pin, lease_ms))

    def _lookup_once(self, engine_id: str, queries: Sequence[GroupQuery], pin: bool, lease_ms: int) -> LookupOutcome:
        req = codec.lookup_request(engine_id, queries, pin, lease_ms)
        try:
            return codec.lookup_from(self._store.Lookup(req, timeout=self.timeout_s))
        except grpc.RpcError as exc:
            raise _error(exc) from exc

    def reserve(self, engine_id: str, group_idx: int, blocks: Sequence[BlockToStore],
                lease_ms: int = 0, lora_name: str | None = None) -> ReserveOutcome:
        req = codec.reserve_request(engine_id, group_idx, blocks, lease_ms, lora_name)
        return codec.reserve_from(self._do(self._store.Reserve, req))

    def commit(self, engine_id: str, reservation_id: str,
               block_hashes: Sequence[bytes] = ()) -> CommitOutcome:
        req = offload_pb2.CommitRequest(engine_id=engine_id, reservation_id=reservation_id,
                                        block_hashes=list(block_hashes))
        resp = self._do(self._store.Commit, req)
        return CommitOutcome(resp.num_committed, resp.log_offset)

    def abort(self, engine_id: str, reservation_id: str) -> int:
        req = offload_pb2.AbortRequest(engine_id=engine_id, reservation_id=reservation_id)
        return int(self._do(self._store.Abort, req).num_aborted)

    def release(self, engine_id: str, lease_id: str) -> int:
        req = offload_pb2.ReleaseRequest(engine_id=engine_id, lease_id=lease_id)
        return int(self._do(self._store.Release, req).num_released)

    def stats(self) -> StoreStats:
        return codec.stats_from(self._do(self._store.Stats, offload_pb2.StatsRequest(), read=True))

    def read_blocks(self, engine_id: str, group_idx: int, block_hashes: Sequence[bytes]) -> list[BlockData]:
        req = offload_pb2.ReadBlocksRequest(engine_id=engine_id, group_idx=group_idx,
                                            block_hashes=list(block_hashes))
        return _call_sync(
            lambda: [BlockData(b.block_hash, b.data, b.checksum)
                     for b in self._store.ReadBlocks(req, timeout=self.timeout_s)],
            self.retry, _NETWORK_READ,
        )

    def snapshot(self) -> Snapshot:
        resp = self._do(self._log.Snapshot, log_pb2.SnapshotRequest(), read=True)
        return snapshot_from_proto(resp)

    def subscribe(self, from_offset: int = 1, follow: bool = False,
                  timeout_s: float | None = None) -> Iterator[LogRecord]:
        """Log records from ``from_offset`` on; with ``follow``, new ones as they come."""
        req = log_pb2.SubscribeRequest(from_offset=from_offset, follow=follow)
        try:
            for msg in self._log.Subscribe(req, timeout=timeout_s):
                yield record_from_proto(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from exc

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)  # lookups in flight end first (within timeout_s)
        self.channel.close()

    def __enter__(self) -> OffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncOffloadClient:
    """asyncio client (grpc.aio); same methods as :class:`OffloadClient`, awaitable."""

    def __init__(self, target: str, timeout_s: float = 5.0, retry: RetryPolicy | None = None, *,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None) -> None:
        self.channel = ClientSecurity(credentials, token).aio_channel(target)
        self._store = offload_pb2_grpc.OffloadStoreStub(self.channel)
        self._log = log_pb2_grpc.EventLogStub(self.channel)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()

    async def _do(self, method: Any, req: Any, read: bool = False) -> Any:
        return await _call_async(lambda: method(req, timeout=self.timeout_s), self.retry,
                                 _NETWORK_READ if read else _NETWORK)

    async def register_engine(self, engine_id: str, incarnation: int, model_namespace: str,
                              groups: Sequence[GroupSpec]) -> EngineRegistration:
        req = codec.register_request(engine_id, incarnation, model_namespace, groups)
        return codec.registration_from(await self._do(self._store.RegisterEngine, req))

    async def lookup(self, engine_id: str, queries: Sequence[GroupQuery], pin: bool = False,
                     lease_ms: int = 0) -> LookupOutcome:
        req = codec.lookup_request(engine_id, queries, pin, lease_ms)
        return codec.lookup_from(await self._do(self._store.Lookup, req, read=not pin))

    async def reserve(self, engine_id: str, group_idx: int, blocks: Sequence[BlockToStore],
                      lease_ms: int = 0, lora_name: str | None = None) -> ReserveOutcome:
        req = codec.reserve_request(engine_id, group_idx, blocks, lease_ms, lora_name)
        return codec.reserve_from(await self._do(self._store.Reserve, req))

    async def commit(self, engine_id: str, reservation_id: str,
                     block_hashes: Sequence[bytes] = ()) -> CommitOutcome:
        req = offload_pb2.CommitRequest(engine_id=engine_id, reservation_id=reservation_id,
                                        block_hashes=list(block_hashes))
        resp = await self._do(self._store.Commit, req)
        return CommitOutcome(resp.num_committed, resp.log_offset)

    async def abort(self, engine_id: str, reservation_id: str) -> int:
        req = offload_pb2.AbortRequest(engine_id=engine_id, reservation_id=reservation_id)
        return int((await self._do(self._store.Abort, req)).num_aborted)

    async def release(self, engine_id: str, lease_id: str) -> int:
        req = offload_pb2.ReleaseRequest(engine_id=engine_id, lease_id=lease_id)
        return int((await self._do(self._store.Release, req)).num_released)

    async def stats(self) -> StoreStats:
        resp = await self._do(self._store.Stats, offload_pb2.StatsRequest(), read=True)
        return codec.stats_from(resp)

    async def read_blocks(self, engine_id: str, group_idx: int,
                          block_hashes: Sequence[bytes]) -> list[BlockData]:
        req = offload_pb2.ReadBlocksRequest(engine_id=engine_id, group_idx=group_idx,
                                            block_hashes=list(block_hashes))

        async def read() -> list[BlockData]:
            return [BlockData(b.block_hash, b.data, b.checksum)
                    async for b in self._store.ReadBlocks(req, timeout=self.timeout_s)]
        return await _call_async(read, self.retry, _NETWORK_READ)

    async def snapshot(self) -> Snapshot:
        resp = await self._do(self._log.Snapshot, log_pb2.SnapshotRequest(), read=True)
        return snapshot_from_proto(resp)

    async def subscribe(self, from_offset: int = 1, follow: bool = False) -> AsyncIterator[LogRecord]:
        req = log_pb2.SubscribeRequest(from_offset=from_offset, follow=follow)
        try:
            async for msg in self._log.Subscribe(req):
                yield record_from_proto(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from exc

    async def close(self) -> None:
        await self.channel.close(None)
