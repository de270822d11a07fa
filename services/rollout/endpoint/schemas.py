"""Request bodies the endpoint accepts, as pydantic models; docs/agents.md lists the same fields.

Unknown top-level fields are refused (400, naming them): a misspelt sampling field would otherwise change
nothing unseen, and in RL an unseen change to sampling is an off-policy sample. OpenAI's own fields are known;
each is either honoured, accepted without effect on sampling (`user`, `metadata`, `store`, ...), or refused
unless it has its default (penalties, `logit_bias`, `response_format` other than text, ...): this engine
cannot apply them, and a sample drawn without them must not pass for one drawn with them. Inside messages, the
fields the OpenAI SDK and NeMo Gym echo back from an answer (`refusal`, `annotations`, the token-id fields)
are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.rollout.endpoint.errors import bad_request

MAX_N = 16
"""Choices per call at most (each is a sequence the engine generates)."""
MAX_STOPS = 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallFunction(Strict):
    name: str = Field(max_length=256)
    arguments: str


class ToolCall(Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None
    """Present when a client rebuilt the call from stream deltas."""


class TextPart(Strict):
    type: Literal["text", "input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Echoed from an earlier answer; ignored (the endpoint keeps its own record of what it generated).
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    reasoning: str | None = None
    """An earlier reply's reasoning, given to the chat template (render.py)."""
    reasoning_content: str | None = None
    """`reasoning`'s older name."""
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None
    routed_experts: Any = None
    token_ids: list[int] | None = None
    policy_versions: list[int] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Stop = str | list[str] | None


class Sampled(Strict):
    """What chat and completions share: sampling, choices, stream, the token-id extras (vLLM's names)."""

    model: str | None = None
    """Any name is accepted: the endpoint serves the policy it holds."""
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    """0: greedy (top_k 1), logprobs under T = 1."""
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """vLLM's extra; -1 or 0: off."""
    stop: Stop = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    return_token_ids: bool = False
    """vLLM's: top-level prompt_token_ids, per choice token_ids and (Flywheel's) policy_versions."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprob entries name tokens "token_id:<id>"."""
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _supported(self):
        refuse_unless_default(self, {"frequency_penalty": (None, 0), "presence_penalty": (None, 0),
                                     "logit_bias": (None, {})})
        stops = self.stop_strings()
        if len(stops) > MAX_STOPS or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} non-empty strings of up to 256 characters")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1, max_length=4096)
    tools: list[Tool] | None = Field(None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    functions: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _chat_supported(self):
        refuse_unless_default(self, {"top_logprobs": (None, 0), "response_format": (None, {"type": "text"}),
                                     "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
                                     "web_search_options": (None,), "moderation": (None,),
                                     "functions": (None,),
                                     "function_call": (None,), "tool_choice": (None, "none", "auto")})
        if {"chat_template", "tools", "messages"} & set(self.chat_template_kwargs or {}):
            raise ValueError("chat_template_kwargs may not set chat_template, tools or messages")
        return self

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        refuse_unless_default(self, {"logprobs": (None, 0), "echo": (False,), "suffix": (None, ""),
                                     "best_of": (None, self.n)})
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch: text, or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class ResponsesRequest(Strict):
    """The Responses API as NeMo Gym's model server takes it (NeMoGymResponseCreateParamsNonStreaming)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=256)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    user: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    prompt: Any = None
    stream: bool | None = None

    @model_validator(mode="after")
    def _responses_supported(self):
        refuse_unless_default(self, {"tool_choice": ("auto", "none", None), "top_logprobs": (None, 0),
                                     "background": (None, False), "previous_response_id": (None,),
                                     "prompt": (None,), "stream": (None, False)})
        if self.text and (self.text.get("format") or {"type": "text"}).get("type") != "text":
            raise ValueError("text.format: only {'type': 'text'} is supported")
        return self


def refuse_unless_default(request: BaseModel, defaults: dict[str, tuple]) -> None:
    """A field this endpoint cannot honour may be sent only with a value that changes nothing."""
    for name, allowed in defaults.items():
        if getattr(request, name) not in allowed:
            raise ValueError(f"{name}={getattr(request, name)!r} is not supported by this endpoint "
                             f"(allowed: {', '.join(repr(a) for a in allowed)})")


def parse(model: type[BaseModel], data: Any) -> Any:
    """`data` as `model`, or a 400 that names the unknown fields or the first wrong one."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(k for k in data if k not in model.model_fields)
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)[:512]}", param=unknown[0][:64],
                          code="unknown_field")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where or 'body'}: {first['msg']}"[:1024], param=where[:128] or None) from None
