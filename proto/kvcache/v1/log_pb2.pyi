from kvcache.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishAck(_message.Message):
    __slots__ = ("engine_id", "incarnation", "seq", "status", "acked_seq", "resend_from", "log_offset", "message", "log_epoch")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[PublishAck.Status]
        STATUS_APPLIED: _ClassVar[PublishAck.Status]
        STATUS_DUPLICATE: _ClassVar[PublishAck.Status]
        STATUS_RESEND: _ClassVar[PublishAck.Status]
        STATUS_REJECTED: _ClassVar[PublishAck.Status]
    STATUS_UNSPECIFIED: PublishAck.Status
    STATUS_APPLIED: PublishAck.Status
    STATUS_DUPLICATE: PublishAck.Status
    STATUS_RESEND: PublishAck.Status
    STATUS_REJECTED: PublishAck.Status
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    RESEND_FROM_FIELD_NUMBER: _ClassVar[int]
    LOG_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: int
    seq: int
    status: PublishAck.Status
    acked_seq: int
    resend_from: int
    log_offset: int
    message: str
    log_epoch: str
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., status: _Optional[_Union[PublishAck.Status, str]] = ..., acked_seq: _Optional[int] = ..., resend_from: _Optional[int] = ..., log_offset: _Optional[int] = ..., message: _Optional[str] = ..., log_epoch: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("from_offset", "follow")
    FROM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    from_offset: int
    follow: bool
    def __init__(self, from_offset: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SourceSnapshot(_message.Message):
    __slots__ = ("source", "incarnation", "last_seq", "events")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    source: str
    incarnation: int
    last_seq: int
    events: _containers.RepeatedCompositeFieldContainer[_events_pb2.KvEvent]
    def __init__(self, source: _Optional[str] = ..., incarnation: _Optional[int] = ..., last_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[_events_pb2.KvEvent, _Mapping]]] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("offset", "sources")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceSnapshot]
    def __init__(self, offset: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceSnapshot, _Mapping]]] = ...) -> None: ...
