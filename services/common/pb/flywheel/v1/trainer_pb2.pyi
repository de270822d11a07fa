from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerServiceStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerServiceStatusResponse(_message.Message):
    __slots__ = ("version", "weight_members", "last_sync_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    weight_members: _containers.RepeatedScalarFieldContainer[str]
    last_sync_seconds: float
    def __init__(self, version: _Optional[int] = ..., weight_members: _Optional[_Iterable[str]] = ..., last_sync_seconds: _Optional[float] = ...) -> None: ...
