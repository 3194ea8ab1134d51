"""Every Redis key of a deployment, built in this one module (DESIGN.md 3.5).

All keys live under ``kvd:{<namespace>}:``: the braces are a Redis Cluster hash tag, so every
key of a namespace hashes to one slot (its scripts and transactions stay single-slot) and
namespaces spread over a cluster's shards. The daemon writes them; the bridge and kvctl read
the log and the head offset. Daemons before DECISIONS 40 used ``kvd:<namespace>:`` without the
braces (:attr:`LogKeys.legacy_prefix`); the daemon renames such keys at start.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogKeys:
    namespace: str = "default"

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in ": \n\t{}"):
            raise ValueError(
                f"namespace must be non-empty without ':', '{{', '}}' or spaces: {self.namespace!r}"
            )

    @property
    def prefix(self) -> str:
        return f"kvd:{{{self.namespace}}}:"

    @property
    def legacy_prefix(self) -> str:
        """The prefix before hash tags (DECISIONS 40): only the key migration reads it."""
        return f"kvd:{self.namespace}:"

    @property
    def log(self) -> str:
        """Stream of LogRecords (see events.records)."""
        return self.prefix + "log"

    @property
    def head(self) -> str:
        """Integer: offset of the last record appended to the log."""
        return self.prefix + "head"

    @property
    def epoch(self) -> str:
        """String: the log's identity, a random id set (SET NX) when a log is started afresh.

        Readers (engines through their acks, the bridge, kvctl) compare it with the one they
        saw: another value, or none, means the log they followed is gone.
        """
        return self.prefix + "epoch"

    @property
    def sources(self) -> str:
        """Hash: source -> msgpack (incarnation, last_seq) fencing position."""
        return self.prefix + "sources"

    @property
    def layouts(self) -> str:
        """Hash: layout key -> msgpack layout record (id, slot bytes, chunks)."""
        return self.prefix + "layouts"

    def blocks(self, layout_id: int) -> str:
        """Hash: digest -> msgpack (slot, group, checksum, parent, tokens...) of committed blocks."""
        return f"{self.prefix}blocks:{layout_id}"

    def engine_blocks(self, engine_id: str) -> str:
        """Set of an engine's GPU-tier hashes that daemons before DECISIONS 33 kept; no longer
        written (the log, checkpoints and Snapshot hold it), deleted at start."""
        return f"{self.prefix}engine:{engine_id}:gpu"

    @property
    def engines(self) -> str:
        """Hash: engine_id -> msgpack registration (incarnation, namespace, group -> layout)."""
        return self.prefix + "engines"

    @property
    def daemon(self) -> str:
        """Hash: the daemon's own fields (incarnation, arena id, bridge seq...)."""
        return self.prefix + "daemon"

    def bridge(self, name: str) -> str:
        """Hash: a bridge's published-seq mapping (seq <-> log offset) for restarts."""
        return f"{self.prefix}bridge:{name}"

    @property
    def owner(self) -> str:
        """String with a TTL: ``{token}:{daemon id}:...`` of the daemon owning the namespace."""
        return self.prefix + "owner"

    @property
    def owner_token(self) -> str:
        """Integer: the last fencing token handed out (INCR), so each owner's is larger."""
        return self.prefix + "owner-token"

    @property
    def checkpoint(self) -> str:
        """String: msgpack list of the complete checkpoints' ids, newest first (the pointer,
        set atomically once every chunk of the newest is written; see offloadd.log.checkpoint)."""
        return self.prefix + "ckpt"

    def checkpoint_manifest(self, ckpt_id: str) -> str:
        """String: msgpack manifest of a checkpoint (offset, epoch, chunk checksums)."""
        return f"{self.prefix}ckpt:{ckpt_id}"

    def checkpoint_chunk(self, ckpt_id: str, index: int) -> str:
        """String: msgpack of one slice of a format 1 checkpoint's sources and blocks (written
        before DECISIONS 60; still read, and deleted with its checkpoint)."""
        return f"{self.prefix}ckpt:{ckpt_id}:{index}"

    @property
    def checkpoint_content_prefix(self) -> str:
        """The prefix of every content-addressed checkpoint chunk (:meth:`checkpoint_content`)."""
        return f"{self.prefix}ckpt:chunk:"

    def checkpoint_content(self, address: str) -> str:
        """String: a format 2 checkpoint chunk, stored under its content address (hex blake2b
        of the bytes) and shared by every checkpoint that lists it (events.checkpoint)."""
        return self.checkpoint_content_prefix + address
