from services.common.pb.flywheel.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleRequest(_message.Message):
    __slots__ = ("step", "prompts_per_step", "max_staleness")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    step: int
    prompts_per_step: int
    max_staleness: int
    def __init__(self, step: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("ready", "missing", "groups", "stale_dropped")
    READY_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    missing: int
    groups: _containers.RepeatedCompositeFieldContainer[_types_pb2.TrajectoryGroup]
    stale_dropped: int
    def __init__(self, ready: _Optional[bool] = ..., missing: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[_types_pb2.TrajectoryGroup, _Mapping]]] = ..., stale_dropped: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("size", "size_by_version", "stale_dropped", "oldest_age_seconds", "capacity", "dead_lettered", "duplicates")
    class SizeByVersionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    size: int
    size_by_version: _containers.ScalarMap[int, int]
    stale_dropped: int
    oldest_age_seconds: float
    capacity: int
    dead_lettered: int
    duplicates: int
    def __init__(self, size: _Optional[int] = ..., size_by_version: _Optional[_Mapping[int, int]] = ..., stale_dropped: _Optional[int] = ..., oldest_age_seconds: _Optional[float] = ..., capacity: _Optional[int] = ..., dead_lettered: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("deleted_groups",)
    DELETED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    deleted_groups: int
    def __init__(self, deleted_groups: _Optional[int] = ...) -> None: ...
