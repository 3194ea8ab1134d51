"""The mapping between a published stream's seq numbers and log offsets.

A published stream (the mixed stream, or one source's stream) numbers the log records it
publishes 0, 1, 2... with no gaps. Records that are not published on the stream (another
source's, or a record without events, which the wire must never carry as an empty batch) take
no seq. The bridge derives this mapping by scanning the log at start, so a restarted bridge
continues the same numbering; it is stored as runs of consecutive offsets, which makes the
common mixed stream (seq = offset - 1) a single run whatever its length.
"""

from __future__ import annotations

from bisect import bisect_right

from bridge.errors import SeqIndexError


class SeqIndex:
    """Seq <-> offset for one stream; seqs start at ``base_seq`` and grow by one per append."""

    def __init__(self, base_seq: int = 0) -> None:
        if base_seq < 0:
            raise SeqIndexError(f"base_seq must be >= 0, got {base_seq}")
        self._base_seq = base_seq
        self._run_seqs: list[int] = []  # first seq of each run
        self._run_offsets: list[int] = []  # offset of that first seq
        self._next_seq = base_seq
        self._last_offset = 0

    @property
    def base_seq(self) -> int:
        """The oldest seq this index knows (older ones left the log before the bridge started)."""
        return self._base_seq

    @property
    def next_seq(self) -> int:
        """The seq the next published record will get."""
        return self._next_seq

    @property
    def last_offset(self) -> int:
        """Offset of the last record of this stream (0 when none)."""
        return self._last_offset

    def __len__(self) -> int:
        return self._next_seq - self._base_seq

    def append(self, offset: int) -> int:
        """Give the record at ``offset`` the next seq and return it."""
        if offset <= self._last_offset:
            raise SeqIndexError(f"offsets must grow: {offset} after {self._last_offset}")
        seq = self._next_seq
        if not self._run_seqs or offset != self._last_offset + 1:
            self._run_seqs.append(seq)
            self._run_offsets.append(offset)
        self._next_seq = seq + 1
        self._last_offset = offset
        return seq

    def rebase(self, base_seq: int) -> None:
        """Shift every seq so the oldest becomes ``base_seq`` (used when the log was trimmed)."""
        delta = base_seq - self._base_seq
        if base_seq < 0:
            raise SeqIndexError(f"base_seq must be >= 0, got {base_seq}")
        self._base_seq = base_seq
        self._next_seq += delta
        self._run_seqs = [s + delta for s in self._run_seqs]

    def offset_of(self, seq: int) -> int:
        """The log offset of ``seq``; SeqIndexError when the index does not hold it."""
        if not self._base_seq <= seq < self._next_seq:
            raise SeqIndexError(f"seq {seq} is not in [{self._base_seq}, {self._next_seq})")
        run = bisect_right(self._run_seqs, seq) - 1
        return self._run_offsets[run] + (seq - self._run_seqs[run])

    def count_through(self, offset: int) -> int:
        """How many indexed records have an offset <= ``offset``."""
        if not self._run_seqs:
            return 0
        run = bisect_right(self._run_offsets, offset) - 1
        if run < 0:
            return 0
        run_end = self._run_seqs[run + 1] if run + 1 < len(self._run_seqs) else self._next_seq
        within = min(offset - self._run_offsets[run] + 1, run_end - self._run_seqs[run])
        return self._run_seqs[run] - self._base_seq + within
