"""Leases (pins taken by Lookup) and reservations (slots handed out by Reserve), with expiry.

Both are tables keyed by an opaque id; the store decides what an expiry does (unpin, or free
the reserved slots). Times are monotonic milliseconds inside the daemon; the wire carries
wall-clock expiry for the client's information only.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def wall_ms_after(ms: int) -> int:
    return time.time_ns() // 1_000_000 + ms


@dataclass
class Lease:
    lease_id: str
    engine_id: str
    expires_ms: int
    blocks: list[tuple[int, bytes]]  # (layout_id, digest), one entry per pin taken


@dataclass
class Reservation:
    reservation_id: str
    engine_id: str
    layout_id: int
    group_idx: int
    lora_name: str | None
    expires_ms: int
    digests: list[bytes] = field(default_factory=list)  # in request order
    committing: bool = False  # a Commit is being logged: neither expiry nor Abort may free it
    provenance: str | None = None  # BlockStored.provenance of its commit (a peer's blocks)


class LeaseTable:
    def __init__(self) -> None:
        self.leases: dict[str, Lease] = {}
        self.reservations: dict[str, Reservation] = {}

    def new_lease(self, engine_id: str, ms: int, blocks: list[tuple[int, bytes]]) -> Lease:
        lease = Lease(uuid.uuid4().hex, engine_id, now_ms() + ms, blocks)
        self.leases[lease.lease_id] = lease
        return lease

    def new_reservation(
        self, engine_id: str, layout_id: int, group_idx: int, lora_name: str | None, ms: int
    ) -> Reservation:
        res = Reservation(uuid.uuid4().hex, engine_id, layout_id, group_idx, lora_name, now_ms() + ms)
        self.reservations[res.reservation_id] = res
        return res

    def get_lease(self, lease_id: str) -> Lease | None:
        return self.leases.get(lease_id)

    def drop_lease(self, lease_id: str) -> None:
        del self.leases[lease_id]

    def get_reservation(self, reservation_id: str) -> Reservation | None:
        return self.reservations.get(reservation_id)

    def drop_reservation(self, reservation_id: str) -> None:
        self.reservations.pop(reservation_id, None)

    def take_expired_leases(self, at_ms: int) -> list[Lease]:
        gone = [lease for lease in self.leases.values() if lease.expires_ms <= at_ms]
        for lease in gone:
            del self.leases[lease.lease_id]
        return gone

    def take_expired_reservations(self, at_ms: int) -> list[Reservation]:
        """Expired reservations, except those being committed (the commit decides them)."""
        gone = [r for r in self.reservations.values() if r.expires_ms <= at_ms and not r.committing]
        for res in gone:
            del self.reservations[res.reservation_id]
        return gone
