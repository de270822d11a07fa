from services.common.pb.flywheel.v1 import types_pb2 as _types_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptsRequest(_message.Message):
    __slots__ = ("env_name", "count", "seed", "offset")
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    count: int
    seed: int
    offset: int
    def __init__(self, env_name: _Optional[str] = ..., count: _Optional[int] = ..., seed: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class PromptsResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[_types_pb2.DatasetRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[_types_pb2.DatasetRow, _Mapping]]] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("messages", "metadata")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    metadata: _struct_pb2.Struct
    def __init__(self, messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("env_name", "episodes", "return_extracted_answer")
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    RETURN_EXTRACTED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    episodes: _containers.RepeatedCompositeFieldContainer[Episode]
    return_extracted_answer: bool
    def __init__(self, env_name: _Optional[str] = ..., episodes: _Optional[_Iterable[_Union[Episode, _Mapping]]] = ..., return_extracted_answer: _Optional[bool] = ...) -> None: ...

class EpisodeResult(_message.Message):
    __slots__ = ("observation", "reward", "named_rewards", "terminated", "next_stop_strings", "metadata", "answer", "error", "observations")
    class NamedRewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    NAMED_REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    NEXT_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    observation: _types_pb2.ChatMessage
    reward: float
    named_rewards: _containers.ScalarMap[str, float]
    terminated: bool
    next_stop_strings: _containers.RepeatedScalarFieldContainer[str]
    metadata: _struct_pb2.Struct
    answer: str
    error: str
    observations: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    def __init__(self, observation: _Optional[_Union[_types_pb2.ChatMessage, _Mapping]] = ..., reward: _Optional[float] = ..., named_rewards: _Optional[_Mapping[str, float]] = ..., terminated: _Optional[bool] = ..., next_stop_strings: _Optional[_Iterable[str]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., answer: _Optional[str] = ..., error: _Optional[str] = ..., observations: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EpisodeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EpisodeResult, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "address", "kind", "timeout_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    kind: str
    timeout_seconds: float
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., kind: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("builtin_kinds", "registered")
    class RegisteredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BUILTIN_KINDS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    builtin_kinds: _containers.RepeatedScalarFieldContainer[str]
    registered: _containers.ScalarMap[str, str]
    def __init__(self, builtin_kinds: _Optional[_Iterable[str]] = ..., registered: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("name", "agent", "timeout_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    agent: _struct_pb2.Struct
    timeout_seconds: float
    def __init__(self, name: _Optional[str] = ..., agent: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunAgentRequest(_message.Message):
    __slots__ = ("env_name", "base_url", "api_key", "model", "task_json", "deadline_s")
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    base_url: str
    api_key: str
    model: str
    task_json: str
    deadline_s: float
    def __init__(self, env_name: _Optional[str] = ..., base_url: _Optional[str] = ..., api_key: _Optional[str] = ..., model: _Optional[str] = ..., task_json: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class RunAgentResponse(_message.Message):
    __slots__ = ("reward", "metrics", "error", "error_reason", "seconds", "named_rewards")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class NamedRewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NAMED_REWARDS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    metrics: _containers.ScalarMap[str, float]
    error: str
    error_reason: str
    seconds: float
    named_rewards: _containers.ScalarMap[str, float]
    def __init__(self, reward: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., error_reason: _Optional[str] = ..., seconds: _Optional[float] = ..., named_rewards: _Optional[_Mapping[str, float]] = ...) -> None: ...

class DescribeEnvironmentRequest(_message.Message):
    __slots__ = ("env_name",)
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    def __init__(self, env_name: _Optional[str] = ...) -> None: ...

class DescribeEnvironmentResponse(_message.Message):
    __slots__ = ("agent_type",)
    AGENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    agent_type: str
    def __init__(self, agent_type: _Optional[str] = ...) -> None: ...
