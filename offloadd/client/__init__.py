"""The client side of offloadd: the only part of the daemon's package that engines import.

The typed client of OffloadStore and EventLog (:mod:`offloadd.client.offload_client`), its
errors (:mod:`offloadd.client.errors`), the domain messages it speaks (offloadd.messages, converted
by offloadd.codec) and the engine's EventIngest stream (:mod:`offloadd.client.ingest_stream`).
Names are re-exported here: import from ``offloadd.client``.
"""

from offloadd.arena import ArenaGeometry, ArenaMapping
from offloadd.client.errors import NotRegistered, OffloadClientError, OffloadUnavailable
from offloadd.client.ingest_stream import IngestStream
from offloadd.client.offload_client import LookupFuture, OffloadClient
from offloadd.messages import (
    BlockData,
    BlockToStore,
    CommitOutcome,
    EngineRegistration,
    GroupArenaInfo,
    GroupHit,
    GroupQuery,
    GroupSpec,
    LookupOutcome,
    ReserveOutcome,
    ReserveStatus,
    StoreStats,
)
from offloadd.slot_generations import SlotGenerations
from rpc.retry import RetryPolicy
from rpc.tls import ClientSecurity

__all__ = [
    "ArenaGeometry", "ArenaMapping", "BlockData", "BlockToStore", "ClientSecurity",
    "CommitOutcome", "EngineRegistration", "GroupArenaInfo", "GroupHit", "GroupQuery",
    "GroupSpec", "IngestStream", "LookupFuture", "LookupOutcome", "NotRegistered",
    "OffloadClient", "OffloadClientError", "OffloadUnavailable", "ReserveOutcome",
    "ReserveStatus", "RetryPolicy", "SlotGenerations", "StoreStats",
]
