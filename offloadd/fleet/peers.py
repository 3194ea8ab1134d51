"""The peers a daemon fetches from: ``name=host:port/namespace[@block port][,...]`` (its
``--fleet-peers``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from events.logkeys import LogKeys

_PEER = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)=(?P<target>[^/=,\s]+:\d{1,5})/(?P<ns>[^/=,@\s]+)"
                   r"(?:@(?P<blocks>\d{1,5}))?$")


@dataclass(frozen=True)
class Peer:
    """Another node: its name (the provenance of blocks fetched from it), its daemon's gRPC
    address and the namespace of its log on the shared Redis deployment."""

    name: str
    target: str
    namespace: str
    block_port: int = 0  # its --fleet-block-port (raw block bytes); 0: read over gRPC

    @property
    def block_address(self) -> tuple[str, int]:
        host = self.target.rsplit(":", 1)[0].strip("[]")
        return host, self.block_port


def parse_peers(text: str) -> tuple[Peer, ...]:
    """Parse ``name=host:port/namespace`` entries separated by commas; ValueError naming the
    entry that is wrong."""
    peers: list[Peer] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        m = _PEER.match(entry)
        if m is None:
            raise ValueError(f"{entry!r}: expected name=host:port/namespace[@block port]")
        LogKeys(m["ns"])  # raises ValueError for a namespace the daemon would refuse
        if any(p.name == m["name"] for p in peers):
            raise ValueError(f"{entry!r}: peer {m['name']!r} named twice")
        peers.append(Peer(m["name"], m["target"], m["ns"], int(m["blocks"] or 0)))
    return tuple(peers)
