"""The fleet index: which node's offloadd holds which block, per layout group, kept from the
nodes' logs (the one reducer over each namespace's log; not a second source of truth).

One :class:`FleetIndex` follows every node's namespace on the shared Redis deployment
(standalone, Sentinel or Cluster: each namespace's log is read from its own shard) and answers,
for a prompt's chain of wire hashes, the longest prefix each node's CPU tier holds, in one
call and no round trip (the state is local; :meth:`refresh` catches up with the logs). A node
whose log epoch changes is read again from its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from events.checkpoint import candidates
from events.logkeys import LogKeys
from events.logreader import LogReader
from events.state import CacheState
from offloadd.tier.source import DAEMON_SOURCE
from rpc.redis_connect import TRANSIENT


@dataclass
class _Node:
    reader: LogReader
    epoch: bytes | None = None
    state: CacheState = field(default_factory=CacheState)
    cpu: dict[int, frozenset[int]] = field(default_factory=dict)  # group -> wire hashes


class FleetIndex:
    """``namespaces``: node name -> its daemon's namespace."""

    def __init__(self, client: Any, namespaces: dict[str, str]) -> None:
        self._client = client
        self._nodes = {name: _Node(LogReader(client, LogKeys(ns), TRANSIENT))
                       for name, ns in namespaces.items()}

    def refresh(self) -> int:
        """Apply what each node's log gained since the last call; how many records."""
        applied = 0
        for node in self._nodes.values():
            epoch = self._client.get(node.reader.keys.epoch)
            if epoch != node.epoch:  # a new log (or the first look): from its start
                self._start(node, epoch)
            records = list(node.reader.iter_range(node.state.offset + 1))
            for record in records:
                node.state.apply(record)
            if records or not node.cpu:
                node.cpu = {g: v for (s, m, g), v in node.state.view().items()
                            if s == DAEMON_SOURCE and m == "CPU"}
            applied += len(records)
        return applied

    def _start(self, node: _Node, epoch: bytes | None) -> None:
        """Read a node's log afresh: from offset 1, or, when it is trimmed, from its newest
        usable checkpoint (events.checkpoint, as the bridge and kvctl bootstrap)."""
        node.epoch, node.state, node.cpu = epoch, CacheState(), {}
        first = node.reader.first_offset()
        if first <= 1:
            return
        text = epoch.decode() if isinstance(epoch, bytes) else epoch
        for c in candidates(node.reader.keys, self._client.mget, text, first):
            if c.snapshot is not None:
                node.state = CacheState.from_snapshot(c.snapshot)
                return

    def holders(self, wire_hashes: Sequence[int], group_idx: int = 0) -> list[tuple[str, int]]:
        """Per node, the longest prefix of ``wire_hashes`` its CPU tier holds, longest first;
        nodes holding none are left out."""
        out = []
        for name, node in self._nodes.items():
            held = node.cpu.get(group_idx, frozenset())
            n = 0
            while n < len(wire_hashes) and wire_hashes[n] in held:
                n += 1
            if n:
                out.append((name, n))
        return sorted(out, key=lambda x: -x[1])
