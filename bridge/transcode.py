"""Stored log record -> the vLLM batch the bridge publishes, without building its ints.

The bridge's publish path: most of a record is its ``token_ids`` and ``block_hashes`` arrays,
which a full decode turns into Python ints only for the encoder to turn them back into the same
msgpack bytes. So the record is read as an ``events.records.RecordView`` (those arrays stay
the stored msgpack bytes) and encoded by ``events.codec_vllm.encode_batch``, which copies them
through: byte for byte the batch of the record's domain events (tests check this); the replay
server and the start-up scan read records this way. The publisher, which applies every record
to its state too, decodes each record once instead (:func:`publish_decoded`, DECISIONS 72), its
token ids left packed (events.packed, DECISIONS 80), and the state checks each event as it
applies it, counting any problem as a violation.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from events.codec_vllm import decode_batch, encode_batch
from events.records import decode_record, decode_record_packed, decode_record_view
from events.schema import LogRecord, SchemaError


class Transcoded(msgspec.Struct, frozen=True):
    """One record's published batch: ``payload`` is what goes in the wire's payload frame."""

    offset: int
    source: str
    num_events: int
    payload: bytes


def transcode_record(data: bytes, *, with_source: bool = True) -> Transcoded:
    """The vLLM map-layout batch of one stored record; SchemaError when it cannot be read."""
    record = decode_record_view(data)
    source = record.source if with_source else None
    payload = encode_batch(record.events, record.ts, source=source)
    return Transcoded(record.offset, record.source, len(record.events), payload)


def batch_for(data: bytes, layout: Literal["map", "legacy"]) -> Transcoded | None:
    """The batch the bridge publishes for one stored record; None when it cannot be read.

    The publisher, the replay server and the start-up scan all decide with this function which
    records take a seq (those with events that can be read), so their numbering agrees.
    """
    try:
        if layout == "map":
            return transcode_record(data)
        record = decode_record(data)  # the legacy layout is rare: the plain codec will do
    except SchemaError:
        return None
    payload = encode_batch(record.events, record.ts, layout="legacy")
    return Transcoded(record.offset, record.source, len(record.events), payload)


def publish_decoded(data: bytes, layout: Literal["map", "legacy"]
                    ) -> tuple[Transcoded | None, LogRecord | None]:
    """:func:`batch_for`, and the record decoded (types only, token ids packed) when that is how
    it was read.

    The publisher's path: the record is decoded once, for the batch and for the state (which
    checks each event as it applies it), rather than as a view here and again there. A record
    with values outside the schema's literals is published from its view as :func:`batch_for`
    does (and the state decodes it again, to count it); the legacy layout is rare: its batch
    alone.
    """
    if layout != "map":
        return batch_for(data, layout), None
    try:
        record = decode_record_packed(data)
    except SchemaError:
        return batch_for(data, layout), None
    payload = encode_batch(record.events, record.ts, source=record.source)
    return Transcoded(record.offset, record.source, len(record.events), payload), record


def relayout(payload: bytes, layout: Literal["map", "legacy"]) -> bytes:
    """A batch we encoded, in ``layout`` (the legacy layout carries no source)."""
    batch = decode_batch(payload)
    source = batch.sources[0] if layout == "map" and batch.sources else None
    return encode_batch(batch.events, batch.ts, layout=layout, dp_rank=batch.dp_rank, source=source)


def takes_seq(batch: Transcoded | None, source: str | None) -> bool:
    """Whether a stream of ``source`` (None: every source) publishes this record.

    The wire never carries an empty batch, so a record without events takes no seq.
    """
    return batch is not None and batch.num_events > 0 and (source is None or batch.source == source)


_RECORD_SHAPE: Final = msgspec.msgpack.Decoder(LogRecord)  # the stored shape, events unvalidated


def is_foreign(offset: int, data: bytes) -> bool:
    """An entry the daemon did not write: no record in it, or a record of another offset.

    The bridge never moves past one (kvctl repair removes it and the daemon writes the real
    record at that offset); a record of the daemon's whose events cannot be read is not foreign:
    it takes no seq, as :func:`batch_for` says.
    """
    if not data:
        return True
    try:
        return _RECORD_SHAPE.decode(data).offset != offset
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
