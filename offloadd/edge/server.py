"""Assembles the daemon: Redis, recovery, store, servicers, health, reflection, metrics, sweeper,
checkpoints (and log trimming, offloadd.log.checkpoint).

``create_server(config)`` recovers state and binds every listener, returning the running
:class:`Daemon` and its bound ports (``grpc_port``/``metrics_port`` 0 pick free ones), so tests
and benchmarks can run it in-process as well as through ``python -m offloadd``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import _async as health_aio  # the public alias health.aio is untyped
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from events.state import CacheState
from events.state_gc import GcPolicy
from offloadd.config import OffloaddConfig
from offloadd.edge.cancel import cancel_and_wait
from offloadd.edge.service import Servicers
from offloadd.fleet.block_port import BlockPort
from offloadd.log.checkpoint import Checkpointer
from offloadd.log.ingest import Ingest
from offloadd.log.legacy_keys import migrate_legacy_keys
from offloadd.log.liveness import Liveness
from offloadd.log.metadata import LogConflict, MetadataStore, RedisUnavailable
from offloadd.log.owner import OwnerLease
from offloadd.log.recovery import RecoveryReport, recover
from offloadd.metrics import DaemonMetrics
from offloadd.tier.source import DAEMON_SOURCE
from offloadd.tier.store import HostStore
from offloadd.tier.writes import StoreWriter
from rpc.auth import AioTokenInterceptor
from rpc.listen import EXCLUSIVE_PORT, add_port
from rpc.redis_connect import connect_async
from rpc.tls import read_token, server_credentials

if TYPE_CHECKING:
    from offloadd.fleet.fill import FleetFill

log = logging.getLogger(__name__)

SERVICE_NAMES = ("kvcache.v1.OffloadStore", "kvcache.v1.EventIngest", "kvcache.v1.EventLog")
VERIFY_BATCH = 128
"""Restored blocks checked per step of the background verification (~1 ms of CPU on the 2-core
machine, against ~12 ms for 2048): a request that arrives while it runs, right after a restart,
waits for one step at most per turn of the event loop, and it takes a few turns (DECISIONS 79)."""
FREEZE_INTERVAL_S = 0.25
"""How often what is alive leaves the garbage collector's view (events.state_gc): the young
objects a collection still walks are at most this long's worth (~12k at 50k events/s)."""


@dataclass(frozen=True)
class Ports:
    grpc_port: int
    metrics_port: int  # -1 when disabled
    unix_socket: str


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _connect_fleet(config: OffloaddConfig, store: HostStore, writer: StoreWriter) -> FleetFill | None:
    """The fleet's fill (None without peers), imported only with peers: it brings the client
    package, ~0.1 s of a lone daemon's start."""
    if not config.fleet_peers:
        return None
    from offloadd.fleet.links import connect_fleet

    return connect_fleet(config, store, writer)


class Daemon:
    def __init__(self, config: OffloaddConfig) -> None:
        self.config = config
        # Read the secrets and TLS material first: a bad file is refused before anything starts.
        token = read_token(config.auth_token_file) if config.auth_token_file else None
        self._tls = (server_credentials(config.tls_cert_file, config.tls_key_file,
                                        config.tls_client_ca_file) if config.is_tls else None)
        self.redis = connect_async(
            config.redis_url, socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s, retry=Retry(NoBackoff(), 0),
        )
        self.state = CacheState()
        self.metadata = MetadataStore(self.redis, config.keys, self.state)
        if config.redis_wait_replicas:
            self.metadata.wait_for_replicas(config.redis_wait_replicas, config.redis_wait_timeout_ms)
        self.owner = OwnerLease(self.redis, config.keys, config.owner_lease_s)
        self.store = HostStore(config, self.metadata, self.state)
        self.writer = StoreWriter(self.store)
        self.fleet = _connect_fleet(config, self.store, self.writer)
        self.ingest = Ingest(self.metadata, self.state, config.max_batch_events, config.max_id_bytes)
        self.liveness = Liveness(self.ingest, config.engine_lease_s)
        self.servicers: Servicers | None = None
        self.metrics = DaemonMetrics()
        self.metrics.watch(self.store, self.ingest)
        if self.fleet is not None:
            self.metrics.watch_fleet(self.fleet.stats)
        self.health = health_aio.HealthServicer()
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", config.max_message_bytes), EXCLUSIVE_PORT],
            interceptors=[AioTokenInterceptor(token)] if token is not None else None,
        )
        self.is_token_required = token is not None
        self.fatal = asyncio.Event()
        self.fatal_reason = ""
        self._sweeper: asyncio.Task[None] | None = None
        self._audit: asyncio.Task[None] | None = None
        self._owner_keeper: asyncio.Task[None] | None = None
        self._checkpoints: asyncio.Task[None] | None = None
        self._gc: asyncio.Task[None] | None = None
        self._fleet_refresh: asyncio.Task[None] | None = None
        self.block_port = (BlockPort(self.store, token, config.fleet_timeout_s)
                           if config.fleet_block_port >= 0 else None)
        self.block_port_bound = -1
        self.checkpointer: Checkpointer | None = None
        self.recovery: RecoveryReport | None = None

    def on_fatal(self, reason: str) -> None:
        """The log moved under us: stop serving; a restart rebuilds from Redis (crash-only)."""
        log.critical("fatal: %s", reason)
        self.fatal_reason = reason
        self.fatal.set()

    async def start(self) -> Ports:
        # Own the namespace before reading it: a second daemon stops here (NamespaceOwned).
        # Renewal starts at once, so a long recovery cannot outlive the lease.
        await migrate_legacy_keys(self.redis, self.config.keys)
        self.metadata.owner = await self.owner.acquire()
        self.metadata.retake_owner = self.owner.retake
        self._owner_keeper = asyncio.create_task(self.owner.keep(self.on_fatal, self.metadata.refence))
        self.recovery = await recover(self.store)
        self.checkpointer = Checkpointer(self.metadata, self.config, self.recovery.log_epoch)
        self.metrics.watch_checkpoints(self.checkpointer.stats)
        # Engines with blocks in the log (their GPU tier; a vLLM source's own CPU tier too)
        # must reconnect within their lease (3.7).
        holding = {s for s, _, _ in self.state.counts() if s != DAEMON_SOURCE}
        self.liveness.lease_all(holding)
        # An engine the log shows with no blocks may have been cleared by the daemon before
        # this restart: its next batch of the same incarnation makes it re-announce (harmless if
        # it really holds nothing: one new incarnation).
        self.ingest.expect_resync(set(self.state.sources()) - {DAEMON_SOURCE} - holding)
        servicers = self.servicers = Servicers(
            self.store, self.writer, self.ingest, self.metadata, self.metrics, self.on_fatal,
            self.liveness, self.fleet,
        )
        for name, methods in servicers.handlers().items():
            self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, methods),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.server,
        )
        cfg = self.config
        address = f"{cfg.grpc_host}:{cfg.grpc_port}"
        grpc_port = add_port(self.server, address, self._tls)
        self._warn_if_exposed()
        metrics_port = -1 if cfg.metrics_port < 0 else self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        if cfg.unix_socket:
            self._bind_unix_socket()
        await self.server.start()
        if self.block_port is not None:
            self.block_port_bound = await self.block_port.start(cfg.grpc_host, cfg.fleet_block_port)
            log.info("block port for peers on %s:%d", cfg.grpc_host, self.block_port_bound)
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sweeper = asyncio.create_task(self._sweep_forever())
        self._audit = asyncio.create_task(self._audit_projection())
        self._checkpoints = asyncio.create_task(self.checkpointer.run())
        self._gc = asyncio.create_task(self._freeze_forever())
        if self.fleet is not None:
            self._fleet_refresh = asyncio.create_task(
                self.fleet.refresh_forever(cfg.fleet_refresh_ms / 1000))
        return Ports(grpc_port, metrics_port, cfg.unix_socket)

    def _bind_unix_socket(self) -> None:
        """Bind the unix socket owner-only (umask 0177 while grpc creates it: no other user can
        connect in the moment before the chmod), then give it the configured mode and group.
        grpc binds in add_insecure_port, so the process-wide umask changes for that call only."""
        cfg = self.config
        old_umask = os.umask(0o177)
        try:
            add_port(self.server, f"unix:{cfg.unix_socket}")
        finally:
            os.umask(old_umask)
        gid = cfg.unix_socket_gid
        if gid is not None:
            os.chown(cfg.unix_socket, -1, gid)
        os.chmod(cfg.unix_socket, cfg.unix_socket_mode)

    def _warn_if_exposed(self) -> None:
        cfg = self.config
        plaintext = self._tls is None
        if self.is_token_required and plaintext:
            log.warning("bearer token over plaintext TCP on %s: anyone who can see the traffic can "
                        "replay it; use TLS (--tls-cert-file/--tls-key-file) unless this is loopback",
                        cfg.grpc_host)
        if not self.is_token_required and not cfg.tls_client_ca_file and not _is_loopback(cfg.grpc_host):
            log.warning("no authentication on %s:%d: any client that reaches it may store, read and "
                        "evict KV blocks; set --auth-token-file or --tls-client-ca-file",
                        cfg.grpc_host, cfg.grpc_port)

    async def _audit_projection(self) -> None:
        """After start: verify restored blocks' bytes; drop what older daemons left in Redis."""
        t0 = time.perf_counter()
        ok, failed = await self.store.integrity.verify_restored(VERIFY_BATCH)
        if ok or failed:
            log.info("restored blocks verified", extra={
                "num_verified": ok, "num_failed": failed, "seconds": time.perf_counter() - t0,
            })
        try:
            if dropped := await self.metadata.drop_legacy_gpu_sets():
                log.info("deleted %d per-engine GPU sets of an older daemon", dropped)
        except RedisUnavailable as exc:
            log.warning("older daemons' GPU sets not deleted: %s", exc)

    async def _freeze_forever(self) -> None:
        """Without it, full collections walk the whole state (every GPU and CPU tier entry)
        each time it grew by a quarter: pauses of 0.1-1 s at a few 100k blocks, in the middle
        of the event stream, and while a checkpoint's child shares the pages, a copy of each."""
        policy = GcPolicy(self.config.full_gc_interval_s)
        while True:
            await asyncio.sleep(FREEZE_INTERVAL_S)
            policy.after_chunk()

    async def _sweep_forever(self) -> None:
        interval = self.config.sweep_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self.store.resolve_quietly()
                self.store.expire()
                if self.store.integrity.has_corrupt:
                    await self.writer.drop_corrupt()
                await self.liveness.expire()
            except RedisUnavailable:
                pass  # retried next round; requests meanwhile get UNAVAILABLE
            except LogConflict as exc:
                self.on_fatal(str(exc))
            except Exception:
                log.exception("sweep failed")

    async def stop(self) -> None:
        """Stop serving: engines are not departing (no clears), the long-lived streams (Publish,
        follow-Subscribe) answer their current message and return, then unary calls in flight
        get ``grace_s``."""
        self.liveness.stop()
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.servicers is not None:
            self.servicers.stop()
        await self.server.stop(self.config.grace_s)
        if self.block_port is not None:
            await self.block_port.stop()
        await self._cancel_tasks()
        await self.owner.release()
        self.metrics.close()
        await self.redis.aclose()
        if self.fleet is not None:
            self.fleet.close()
        self.store.close()

    async def _cancel_tasks(self) -> None:
        for task in (self._sweeper, self._audit, self._checkpoints, self._owner_keeper,
                     self._fleet_refresh, self._gc):
            if task is not None:  # one cancel can be lost on Python 3.11 (offloadd.edge.cancel)
                await cancel_and_wait(task)


async def create_server(config: OffloaddConfig) -> tuple[Daemon, Ports]:
    daemon = Daemon(config)
    try:
        ports = await daemon.start()
    except BaseException:
        await daemon._cancel_tasks()
        await daemon.owner.release()
        await daemon.redis.aclose()
        daemon.store.close()
        raise
    return daemon, ports
