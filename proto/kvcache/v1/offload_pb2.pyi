from kvcache.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupLayout(_message.Message):
    __slots__ = ("group_idx", "kind", "sliding_window", "block_size", "block_bytes", "dtype", "layout")
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    group_idx: int
    kind: _events_pb2.KvCacheSpecKind
    sliding_window: int
    block_size: int
    block_bytes: int
    dtype: str
    layout: str
    def __init__(self, group_idx: _Optional[int] = ..., kind: _Optional[_Union[_events_pb2.KvCacheSpecKind, str]] = ..., sliding_window: _Optional[int] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine_id", "incarnation", "model_namespace", "groups")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: int
    model_namespace: str
    groups: _containers.RepeatedCompositeFieldContainer[GroupLayout]
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., model_namespace: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[GroupLayout, _Mapping]]] = ...) -> None: ...

class GroupArena(_message.Message):
    __slots__ = ("group_idx", "layout_id", "slot_bytes", "slots_per_chunk", "max_slots", "chunk_path_template")
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_PATH_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    group_idx: int
    layout_id: int
    slot_bytes: int
    slots_per_chunk: int
    max_slots: int
    chunk_path_template: str
    def __init__(self, group_idx: _Optional[int] = ..., layout_id: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slots_per_chunk: _Optional[int] = ..., max_slots: _Optional[int] = ..., chunk_path_template: _Optional[str] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("groups", "hash_algo")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupArena]
    hash_algo: str
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupArena, _Mapping]]] = ..., hash_algo: _Optional[str] = ...) -> None: ...

class GroupQuery(_message.Message):
    __slots__ = ("group_idx", "block_hashes", "prefix_only")
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    group_idx: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_only: bool
    def __init__(self, group_idx: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., prefix_only: _Optional[bool] = ...) -> None: ...

class GroupResult(_message.Message):
    __slots__ = ("group_idx", "num_prefix", "slots", "generations")
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    group_idx: int
    num_prefix: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_idx: _Optional[int] = ..., num_prefix: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("engine_id", "queries", "pin", "lease_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    queries: _containers.RepeatedCompositeFieldContainer[GroupQuery]
    pin: bool
    lease_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., queries: _Optional[_Iterable[_Union[GroupQuery, _Mapping]]] = ..., pin: _Optional[bool] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("results", "lease_id", "lease_expires_unix_ms")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GroupResult]
    lease_id: str
    lease_expires_unix_ms: int
    def __init__(self, results: _Optional[_Iterable[_Union[GroupResult, _Mapping]]] = ..., lease_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class BlockToStore(_message.Message):
    __slots__ = ("block_hash", "parent_block_hash", "token_ids", "extra_keys")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("engine_id", "group_idx", "blocks", "lease_ms", "lora_name")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    group_idx: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockToStore]
    lease_ms: int
    lora_name: str
    def __init__(self, engine_id: _Optional[str] = ..., group_idx: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockToStore, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("status", "slot", "generation")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[Reservation.Status]
        STATUS_RESERVED: _ClassVar[Reservation.Status]
        STATUS_ALREADY_STORED: _ClassVar[Reservation.Status]
        STATUS_IN_FLIGHT: _ClassVar[Reservation.Status]
        STATUS_NO_SPACE: _ClassVar[Reservation.Status]
    STATUS_UNSPECIFIED: Reservation.Status
    STATUS_RESERVED: Reservation.Status
    STATUS_ALREADY_STORED: Reservation.Status
    STATUS_IN_FLIGHT: Reservation.Status
    STATUS_NO_SPACE: Reservation.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    status: Reservation.Status
    slot: int
    generation: int
    def __init__(self, status: _Optional[_Union[Reservation.Status, str]] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "blocks", "lease_expires_unix_ms")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[Reservation]
    lease_expires_unix_ms: int
    def __init__(self, reservation_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("engine_id", "reservation_id", "block_hashes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reservation_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_committed", "log_offset")
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LOG_OFFSET_FIELD_NUMBER: _ClassVar[int]
    num_committed: int
    log_offset: int
    def __init__(self, num_committed: _Optional[int] = ..., log_offset: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("engine_id", "reservation_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reservation_id: str
    def __init__(self, engine_id: _Optional[str] = ..., reservation_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("engine_id", "lease_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_id: str
    def __init__(self, engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayoutStats(_message.Message):
    __slots__ = ("layout_id", "slot_bytes", "num_slots", "num_ready", "num_reserved", "num_pinned")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_READY_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    layout_id: int
    slot_bytes: int
    num_slots: int
    num_ready: int
    num_reserved: int
    num_pinned: int
    def __init__(self, layout_id: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_ready: _Optional[int] = ..., num_reserved: _Optional[int] = ..., num_pinned: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "evictions", "log_offset", "layouts", "num_engines")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LOG_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    evictions: int
    log_offset: int
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutStats]
    num_engines: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., log_offset: _Optional[int] = ..., layouts: _Optional[_Iterable[_Union[LayoutStats, _Mapping]]] = ..., num_engines: _Optional[int] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "group_idx", "block_hashes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    group_idx: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., group_idx: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("block_hash", "data", "checksum", "parent_block_hash", "token_ids", "extra_keys", "lora_name")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    data: bytes
    checksum: int
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: bytes
    lora_name: str
    def __init__(self, block_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[bytes] = ..., lora_name: _Optional[str] = ...) -> None: ...
