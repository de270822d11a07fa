from services.common.pb.flywheel.v1 import types_pb2 as _types_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvironmentSpec(_message.Message):
    __slots__ = ("name", "kind", "address", "rows", "jsonl_path", "weight", "max_turns", "sampling", "reward_scale", "timeout_seconds", "agent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    JSONL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REWARD_SCALE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    address: str
    rows: _containers.RepeatedCompositeFieldContainer[_types_pb2.DatasetRow]
    jsonl_path: str
    weight: float
    max_turns: int
    sampling: _types_pb2.SamplingParams
    reward_scale: float
    timeout_seconds: float
    agent: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., address: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[_types_pb2.DatasetRow, _Mapping]]] = ..., jsonl_path: _Optional[str] = ..., weight: _Optional[float] = ..., max_turns: _Optional[int] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., reward_scale: _Optional[float] = ..., timeout_seconds: _Optional[float] = ..., agent: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class SubmitEnvironmentRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: EnvironmentSpec
    def __init__(self, spec: _Optional[_Union[EnvironmentSpec, _Mapping]] = ...) -> None: ...

class SubmitEnvironmentResponse(_message.Message):
    __slots__ = ("num_prompts",)
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    num_prompts: int
    def __init__(self, num_prompts: _Optional[int] = ...) -> None: ...

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvironmentStatus(_message.Message):
    __slots__ = ("spec", "leased_groups")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    spec: EnvironmentSpec
    leased_groups: int
    def __init__(self, spec: _Optional[_Union[EnvironmentSpec, _Mapping]] = ..., leased_groups: _Optional[int] = ...) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("environments",)
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentStatus]
    def __init__(self, environments: _Optional[_Iterable[_Union[EnvironmentStatus, _Mapping]]] = ...) -> None: ...

class RemoveEnvironmentRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveEnvironmentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("loaded_version", "trained_step", "next_target_step", "outstanding_groups", "releases", "rollout_workers", "done")
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINED_STEP_FIELD_NUMBER: _ClassVar[int]
    NEXT_TARGET_STEP_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    loaded_version: int
    trained_step: int
    next_target_step: int
    outstanding_groups: int
    releases: int
    rollout_workers: _containers.RepeatedScalarFieldContainer[str]
    done: bool
    def __init__(self, loaded_version: _Optional[int] = ..., trained_step: _Optional[int] = ..., next_target_step: _Optional[int] = ..., outstanding_groups: _Optional[int] = ..., releases: _Optional[int] = ..., rollout_workers: _Optional[_Iterable[str]] = ..., done: _Optional[bool] = ...) -> None: ...
