from services.common.pb.flywheel.v1 import types_pb2 as _types_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("messages", "n", "sampling", "env_name", "metadata", "max_turns", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    n: int
    sampling: _types_pb2.SamplingParams
    env_name: str
    metadata: _struct_pb2.Struct
    max_turns: int
    tools: _containers.RepeatedCompositeFieldContainer[_types_pb2.ToolDefinition]
    def __init__(self, messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., env_name: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., max_turns: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[_types_pb2.ToolDefinition, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[_types_pb2.Completion, _Mapping]]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "completions")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("teacher",)
    TEACHER_FIELD_NUMBER: _ClassVar[int]
    teacher: _containers.RepeatedCompositeFieldContainer[_types_pb2.TeacherTopK]
    def __init__(self, teacher: _Optional[_Iterable[_Union[_types_pb2.TeacherTopK, _Mapping]]] = ...) -> None: ...
