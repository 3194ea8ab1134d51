"""``BlockStored`` with its token ids kept as the msgpack array they are stored as.

A stored event's token ids are most of its bytes (``block_size`` per block: 16 in vLLM's
shape), and nothing on the hot paths reads them one by one: the daemon writes them into the
log, the bridge copies them onto the wire, the reducer checks only how many there are. As
Python ints they cost ~40 us of decoding per 2,000 ids and ~30 bytes each for as long as the
block is resident, in every process that holds a state (DECISIONS 80). :data:`PackedStored`
is ``BlockStored`` with ``token_ids`` a ``msgspec.Raw`` holding the msgpack array: the same tag,
field names, field order and defaults, so msgspec encodes it byte for byte as the
``BlockStored`` it stands for, and decodes a stored ``BlockStored`` into it without building
the ids. Every other field has the schema's type and is checked as the schema checks it.

Where the ids are needed (a snapshot's chains, a block's entry, a protobuf message)
:func:`token_ids` reads them, and :func:`unpacked` turns the event into a ``BlockStored``. The
count is read from the array's header (:func:`count_ids`); the ids themselves are checked when
they are read: a producer of packed events (the daemon's ingest) packs ids it has checked,
and a reader of the log trusts the ids the daemon wrote, as the bridge's replay does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from events.schema import BlockStored, SchemaError


def _packed_class() -> Any:
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(BlockStored):
        tp = msgspec.Raw if f.name == "token_ids" else f.type
        fields.append((f.name, tp) if f.default is msgspec.NODEFAULT else (f.name, tp, f.default))
    config = BlockStored.__struct_config__
    return msgspec.defstruct(
        "PackedStored", fields, tag=config.tag, tag_field=config.tag_field,
        omit_defaults=config.omit_defaults, frozen=True, module=__name__,
    )


# Typed as the class it stands for, so that ``type(event) is PackedStored`` narrows to an event
# with BlockStored's fields; its ``token_ids`` is a msgspec.Raw all the same.
PackedStored: Final[type[BlockStored]] = _packed_class()

_ENCODER: Final = msgspec.msgpack.Encoder()
_IDS: Final = msgspec.msgpack.Decoder(tuple[int, ...])


def pack(ids: Sequence[int]) -> msgspec.Raw:
    """``ids`` as a packed ``token_ids`` (the msgpack array msgspec writes for them)."""
    return msgspec.Raw(_ENCODER.encode(ids))


_HEAD: Final = struct.Struct(">BH").unpack_from  # a first byte and a big-endian uint16
_FIRST: Final = struct.Struct("B").unpack_from
_UINT32: Final = struct.Struct(">I").unpack_from


def count_ids(raw: msgspec.Raw) -> int:
    """How many items the msgpack array in ``raw`` holds, from its header; -1 when ``raw`` is
    not an array. Once per stored event in the reducer: ~80 ns (a memoryview costs 4x that)."""
    first: int
    count: int
    if len(raw) >= 3:
        first, count = _HEAD(raw)
        if first == 0xDC:  # array 16: 16..65535 ids, a block of vLLM's 16 and up
            return count
    elif not raw:
        return -1
    else:
        (first,) = _FIRST(raw)
    if 0x90 <= first <= 0x9F:  # fixarray
        return first & 0x0F
    if first == 0xDD and len(raw) >= 5:  # array 32
        (count,) = _UINT32(raw, 1)
        return count
    return -1


def token_ids(event: BlockStored) -> tuple[int, ...]:
    """The token ids of a ``BlockStored`` or :data:`PackedStored`; SchemaError when a packed
    event's ids cannot be read as integers."""
    ids: Any = event.token_ids
    if type(ids) is not msgspec.Raw:
        return ids  # type: ignore[no-any-return]
    try:
        return _IDS.decode(ids)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"BlockStored.token_ids: not an array of integers: {exc}") from exc


def unpacked(event: BlockStored) -> BlockStored:
    """``event`` as a ``BlockStored`` (itself when it is one); SchemaError as :func:`token_ids`."""
    if type(event) is BlockStored:
        return event
    values = msgspec.structs.asdict(event)
    values["token_ids"] = token_ids(event)
    return BlockStored(**values)


def packed(event: BlockStored) -> BlockStored:
    """``event`` with its token ids packed (a :data:`PackedStored`)."""
    values = msgspec.structs.asdict(event)
    values["token_ids"] = pack(event.token_ids)
    return PackedStored(**values)
