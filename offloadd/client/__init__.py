"""The client side of offloadd: the only part of the daemon's package that engines import.

Typed clients of OffloadStore and EventLog (:mod:`offloadd.client.offload_client`), their
proto <-> domain codec (:mod:`offloadd.client.codec`) and the engine's EventIngest stream
(:mod:`offloadd.client.ingest_stream`). Names are re-exported here: import from
``offloadd.client``.
"""

from offloadd.client.offload_client import (
    ArenaGeometry,
    ArenaMapping,
    AsyncOffloadClient,
    BlockData,
    BlockToStore,
    ClientSecurity,
    CommitOutcome,
    EngineRegistration,
    GroupArenaInfo,
    GroupHit,
    GroupQuery,
    GroupSpec,
    IngestStream,
    LookupFuture,
    LookupOutcome,
    OffloadClient,
    OffloadClientError,
    OffloadUnavailable,
    ReserveOutcome,
    ReserveStatus,
    RetryPolicy,
    SlotGenerations,
    StoreStats,
)

__all__ = [
    "ArenaGeometry", "ArenaMapping", "AsyncOffloadClient", "BlockData", "BlockToStore",
    "ClientSecurity", "CommitOutcome", "EngineRegistration", "GroupArenaInfo", "GroupHit",
    "GroupQuery", "GroupSpec", "IngestStream", "LookupFuture", "LookupOutcome", "OffloadClient",
    "OffloadClientError", "OffloadUnavailable", "ReserveOutcome", "ReserveStatus", "RetryPolicy",
    "SlotGenerations", "StoreStats",
]
