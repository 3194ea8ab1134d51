from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_GPU: _ClassVar[Medium]
    MEDIUM_CPU: _ClassVar[Medium]

class KvCacheSpecKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_SPEC_KIND_UNSPECIFIED: _ClassVar[KvCacheSpecKind]
    KV_CACHE_SPEC_KIND_FULL_ATTENTION: _ClassVar[KvCacheSpecKind]
    KV_CACHE_SPEC_KIND_SLIDING_WINDOW: _ClassVar[KvCacheSpecKind]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_GPU: Medium
MEDIUM_CPU: Medium
KV_CACHE_SPEC_KIND_UNSPECIFIED: KvCacheSpecKind
KV_CACHE_SPEC_KIND_FULL_ATTENTION: KvCacheSpecKind
KV_CACHE_SPEC_KIND_SLIDING_WINDOW: KvCacheSpecKind

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx", "kv_cache_spec_kind", "sliding_window", "lora_name", "extra_keys", "provenance")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: Medium
    group_idx: int
    kv_cache_spec_kind: KvCacheSpecKind
    sliding_window: int
    lora_name: str
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    provenance: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[_Union[Medium, str]] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[_Union[KvCacheSpecKind, str]] = ..., sliding_window: _Optional[int] = ..., lora_name: _Optional[str] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., provenance: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "group_idx")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: Medium
    group_idx: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[_Union[Medium, str]] = ..., group_idx: _Optional[int] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: Medium
    def __init__(self, medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("engine_id", "incarnation", "seq", "ts", "events", "departing")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DEPARTING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: int
    seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    departing: bool
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., departing: _Optional[bool] = ...) -> None: ...

class LogRecord(_message.Message):
    __slots__ = ("offset", "source", "incarnation", "source_seq", "ts", "events")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    source: str
    incarnation: int
    source_seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, offset: _Optional[int] = ..., source: _Optional[str] = ..., incarnation: _Optional[int] = ..., source_seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...
