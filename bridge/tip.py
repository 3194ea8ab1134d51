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

A blocking read starts with a blocking XREAD after the position (it answers at once when records
are there), and the read is then made from the published one: records taken from XREAD alone
could come from another connection, still on the old primary, than the check. With the epoch
key, the XREAD, the check's XRANGE and the epoch's GET go as one pipeline on one connection: the
server runs the reads once the wait is over, one round trip in all. An XREAD that times out is
followed by the check too, so a log that went back is noticed within one wait. Cost: the
published record travels again with each chunk. (Before, a blocking read checked, waited,
checked again and read the epoch: four round trips per record at a steady rate; DECISIONS 72.)
"""

from __future__ import annotations

from dataclasses import dataclass

from events.logreader import LogReader, RawEntry


@dataclass(frozen=True)
class Read:
    entries: list[RawEntry]  # the records after the position (a gap when the first is not next)
    rewound: bool = False  # the record at the position is not the one published
    epoch_read: bool = False  # whether ``epoch`` was read, after the records
    epoch: str | None = None  # the log's epoch key then (None: absent)


class TipReader:
    """Reads after a published position through ``reader``, ``chunk`` records at most; with
    an ``epoch_key``, each read with the check also reads the log's epoch, after the records
    and in the same round trip (bridge.epoch's check of a read then costs none of its own)."""

    def __init__(self, reader: LogReader, chunk: int, epoch_key: str = "") -> None:
        self._reader = reader
        self._chunk = chunk
        self._epoch_key = epoch_key

    def read(self, position: int, published: bytes | None, block_ms: int) -> Read:
        """The records after ``position``, waiting up to ``block_ms`` for one; ``published``: the
        bytes of the record published at ``position`` (None: unknown, nothing is checked)."""
        if position == 0 or published is None:
            return Read(self._reader.poll_raw(position, block_ms, self._chunk))
        if block_ms > 0 and not self._epoch_key:
            # Wait first (at once when records are there); whatever woke it, or nothing, the
            # read that counts is made with the check.
            self._reader.poll_raw(position, block_ms, 1)
            block_ms = 0
        return self._from_tip(position, published, block_ms)

    def _from_tip(self, position: int, published: bytes, block_ms: int = 0) -> Read:
        epoch_read, epoch = False, None
        if self._epoch_key:
            # The wait, the check and the epoch in one round trip (a pipeline: the server runs
            # the reads after the wait is over, on this connection).
            entries, raw = self._reader.read_range_raw_and_get(
                position, self._chunk + 1, self._epoch_key, wait_after=position, block_ms=block_ms)
            epoch_read, epoch = True, None if raw is None else raw.decode(errors="replace")
        else:
            entries = self._reader.read_range_raw(position, None, self._chunk + 1)
        if not entries:
            return Read([], rewound=True)  # the log ends before the position now
        if entries[0][0] != position:
            return Read(entries, False, epoch_read, epoch)  # the position was trimmed: a gap
        if entries[0][1] != published:
            return Read([], rewound=True)
        return Read(entries[1:], False, epoch_read, epoch)
