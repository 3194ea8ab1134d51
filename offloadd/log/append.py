"""One append to the log (:class:`Append`), and how the appends of a write group are answered
when they are not written."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from events.records import encode_record
from events.schema import Event, LogRecord, SchemaError
from offloadd.log.projection import Pipe

log = logging.getLogger(__name__)


@dataclass
class Append:
    """One record to append, with its projection updates and its in-memory effect."""

    source: str
    incarnation: int
    seq: int | Callable[[], int]  # a callable is evaluated under the writer lock
    events: tuple[Event, ...]
    project: Callable[[Pipe], None]
    apply: Callable[[LogRecord], None]
    revert: Callable[[], None] = lambda: None
    ts: float = field(default_factory=time.time)


Pending = tuple[Append, "asyncio.Future[LogRecord]"]  # an append and its caller's answer
Batch = list[tuple[LogRecord, bytes, Append]]  # the records of one write, encoded


class ProjectFailed(Exception):
    """``item``'s project callback raised while its write was being built."""

    def __init__(self, item: Append) -> None:
        super().__init__(f"project callback of a {item.source} record raised")
        self.item = item


def revert(item: Append) -> None:
    try:
        item.revert()
    except Exception:  # a bug in a revert callback must not stop the others'
        log.exception("revert failed")


def fail(
    group: list[Pending], exc: Exception, cause: BaseException | None = None,
    is_reverted: bool = True,
) -> None:
    """Answer every unanswered append of ``group`` with ``exc``; with ``is_reverted``, nothing
    of them is in the log, so each one's ``revert`` undoes what its caller did ahead of the
    write (reserved victims, a commit's flag). A write in doubt is reverted when resolved
    instead."""
    exc.__cause__ = cause
    for item, future in group:
        if future.done():
            continue
        future.set_exception(exc)
        if is_reverted:
            revert(item)


def encode_group(group: list[Pending], head: int) -> Batch:
    """Number ``group``'s records from ``head + 1`` and encode them; one that cannot be encoded
    (a value msgpack cannot hold) is refused alone with a SchemaError and reverted, the others
    close up."""
    batch: Batch = []
    last_seq: dict[str, int] = {}  # callable seqs: the 2nd record of a source in a group is +1
    for item, future in group:
        if callable(item.seq):
            prev = last_seq.get(item.source)
            seq = item.seq() if prev is None else prev + 1
        else:
            seq = item.seq
        record = LogRecord(head + 1 + len(batch), item.source, item.incarnation, seq,
                           item.ts, item.events)
        try:
            data = encode_record(record)
        except Exception as exc:  # msgspec: TypeError, OverflowError, EncodeError...
            log.error("record of %s seq %d cannot be logged: %r", item.source, seq, exc)
            fail([(item, future)], SchemaError(
                f"record of {item.source} (seq {seq}) cannot be logged: {exc}"), exc)
            continue
        last_seq[item.source] = seq
        batch.append((record, data, item))
    return batch
