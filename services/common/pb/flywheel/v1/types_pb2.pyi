from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TurnFlaw(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_FLAW_UNSPECIFIED: _ClassVar[TurnFlaw]
    TURN_FLAW_INVALID_TOOL_CALL: _ClassVar[TurnFlaw]
    TURN_FLAW_MALFORMED_THINKING: _ClassVar[TurnFlaw]
TURN_FLAW_UNSPECIFIED: TurnFlaw
TURN_FLAW_INVALID_TOOL_CALL: TurnFlaw
TURN_FLAW_MALFORMED_THINKING: TurnFlaw

class DatasetRow(_message.Message):
    __slots__ = ("messages", "metadata", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    metadata: _struct_pb2.Struct
    tools: _containers.RepeatedCompositeFieldContainer[ToolDefinition]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[ToolDefinition, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "type", "function")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function: FunctionCall
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class FunctionCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolDefinition(_message.Message):
    __slots__ = ("type", "function")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    type: str
    function: FunctionDefinition
    def __init__(self, type: _Optional[str] = ..., function: _Optional[_Union[FunctionDefinition, _Mapping]] = ...) -> None: ...

class FunctionDefinition(_message.Message):
    __slots__ = ("name", "description", "parameters_json", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_strings")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ...) -> None: ...

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "prompt_id", "env_name", "messages", "metadata", "num_generations", "target_step", "max_turns", "sampling", "leased_at_unix_ns", "reward_scale", "tools")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    REWARD_SCALE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    env_name: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    metadata: _struct_pb2.Struct
    num_generations: int
    target_step: int
    max_turns: int
    sampling: SamplingParams
    leased_at_unix_ns: int
    reward_scale: float
    tools: _containers.RepeatedCompositeFieldContainer[ToolDefinition]
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., env_name: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., num_generations: _Optional[int] = ..., target_step: _Optional[int] = ..., max_turns: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., leased_at_unix_ns: _Optional[int] = ..., reward_scale: _Optional[float] = ..., tools: _Optional[_Iterable[_Union[ToolDefinition, _Mapping]]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "generated_mask", "generation_logprobs", "version_start", "version_end", "reward", "named_rewards", "text", "truncated", "turns", "answer", "messages", "teacher", "metrics", "flaws")
    class NamedRewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_MASK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_START_FIELD_NUMBER: _ClassVar[int]
    VERSION_END_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    NAMED_REWARDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEACHER_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FLAWS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_mask: _containers.RepeatedScalarFieldContainer[bool]
    generation_logprobs: _containers.RepeatedScalarFieldContainer[float]
    version_start: int
    version_end: int
    reward: float
    named_rewards: _containers.ScalarMap[str, float]
    text: str
    truncated: bool
    turns: int
    answer: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    teacher: TeacherTopK
    metrics: _containers.ScalarMap[str, float]
    flaws: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., generated_mask: _Optional[_Iterable[bool]] = ..., generation_logprobs: _Optional[_Iterable[float]] = ..., version_start: _Optional[int] = ..., version_end: _Optional[int] = ..., reward: _Optional[float] = ..., named_rewards: _Optional[_Mapping[str, float]] = ..., text: _Optional[str] = ..., truncated: _Optional[bool] = ..., turns: _Optional[int] = ..., answer: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., teacher: _Optional[_Union[TeacherTopK, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., flaws: _Optional[_Iterable[int]] = ...) -> None: ...

class TeacherTopK(_message.Message):
    __slots__ = ("k", "logits", "token_ids")
    K_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    k: int
    logits: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k: _Optional[int] = ..., logits: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("group_id", "prompt_id", "env_name", "target_step", "prompt_token_ids", "completions", "version_start", "generation_seconds", "environment_seconds", "worker_id", "leased_at_unix_ns", "finished_at_unix_ns", "traceparent")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_START_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    env_name: str
    target_step: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    version_start: int
    generation_seconds: float
    environment_seconds: float
    worker_id: str
    leased_at_unix_ns: int
    finished_at_unix_ns: int
    traceparent: str
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., env_name: _Optional[str] = ..., target_step: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., version_start: _Optional[int] = ..., generation_seconds: _Optional[float] = ..., environment_seconds: _Optional[float] = ..., worker_id: _Optional[str] = ..., leased_at_unix_ns: _Optional[int] = ..., finished_at_unix_ns: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class WeightAnnouncement(_message.Message):
    __slots__ = ("version", "epoch", "manifest_digest", "store_address", "backend", "members", "path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    manifest_digest: str
    store_address: str
    backend: str
    members: _containers.RepeatedScalarFieldContainer[str]
    path: str
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., store_address: _Optional[str] = ..., backend: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., path: _Optional[str] = ...) -> None: ...

class WeightLoaded(_message.Message):
    __slots__ = ("worker_id", "version", "checksum")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: int
    checksum: str
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class RolloutHeartbeat(_message.Message):
    __slots__ = ("worker_id", "loaded_version", "in_flight", "host")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    loaded_version: int
    in_flight: int
    host: str
    def __init__(self, worker_id: _Optional[str] = ..., loaded_version: _Optional[int] = ..., in_flight: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "metrics", "final", "checkpoint_step")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    final: bool
    checkpoint_step: int
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., final: _Optional[bool] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...

class StaleGroups(_message.Message):
    __slots__ = ("group_ids",)
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PoisonedGroup(_message.Message):
    __slots__ = ("group_id", "prompt_id", "env_name", "deliveries", "error", "worker_id")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    env_name: str
    deliveries: int
    error: str
    worker_id: str
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., env_name: _Optional[str] = ..., deliveries: _Optional[int] = ..., error: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...
