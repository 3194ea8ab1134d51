"""Reading the log on from the record published last, and noticing when that record changed.

A failover can leave the bridge on a log with the same epoch that does not continue what it
published: a replica that had not synced was promoted (DECISIONS 59, 62; the sentinel test), and
records the bridge read from the node before it are not the new primary's. At an offset both
nodes hold, the new primary has another record (a write in doubt settled either way, a resend
at another offset); or its log ends before the bridge's position. The epoch key came along with
the rest of the dataset, so bridge.epoch sees nothing; a bridge that reads on after its position
publishes the new primary's records on top of a state (and subscribers' states) holding the old
primary's, and keeps blocks the log never stored (found as 4 CPU blocks too many).

So every read that has a published record behind it starts *at* that record: one XRANGE returns
it together with the records after it, from one server at one moment, and its bytes are
compared with those published. Equal: the log is the one published (every record goes in with
its ``ts``, so two histories do not write one record's bytes at one offset), and the records
after it continue it. Different, or gone with nothing after it: :attr:`Read.rewound`, and the
bridge publishes the log again as for a new epoch (bridge.epoch: AllBlocksCleared per source,
then the log, seqs continuing). A first record past the position is a trimmed gap (the caller's).

When nothing new is there, a blocking XREAD waits for the next record and the read is then made
again from the published one: records taken from XREAD alone could come from another connection,
still on the old primary, than the check. Cost: the published record travels again with each
chunk, and a record arriving after an idle wait costs two more round trips (XREAD, XRANGE).
"""

from __future__ import annotations

from dataclasses import dataclass

from events.logreader import LogReader, RawEntry


@dataclass(frozen=True)
class Read:
    entries: list[RawEntry]  # the records after the position (a gap when the first is not next)
    rewound: bool = False  # the record at the position is not the one published


class TipReader:
    """Reads after a published position through ``reader``, ``chunk`` records at most."""

    def __init__(self, reader: LogReader, chunk: int) -> None:
        self._reader = reader
        self._chunk = chunk

    def read(self, position: int, published: bytes | None, block_ms: int) -> Read:
        """The records after ``position``, waiting up to ``block_ms`` for one; ``published``: the
        bytes of the record published at ``position`` (None: unknown, nothing is checked)."""
        if position == 0 or published is None:
            return Read(self._reader.poll_raw(position, block_ms, self._chunk))
        read = self._from_tip(position, published)
        if read.rewound or read.entries or block_ms <= 0:
            return read
        if not self._reader.poll_raw(position, block_ms, 1):
            return read
        return self._from_tip(position, published)  # woken by a record: read it with the check

    def _from_tip(self, position: int, published: bytes) -> Read:
        entries = self._reader.read_range_raw(position, None, self._chunk + 1)
        if not entries:
            return Read([], rewound=True)  # the log ends before the position now
        if entries[0][0] != position:
            return Read(entries)  # the position was trimmed: a gap
        if entries[0][1] != published:
            return Read([], rewound=True)
        return Read(entries[1:])
