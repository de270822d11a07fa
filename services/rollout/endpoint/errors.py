"""Refusals in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with a 4xx status.

The OpenAI SDK raises the matching exception (BadRequestError for 400, AuthenticationError for 401,
NotFoundError for 404, ...) with the message, so an agent sees why its call was refused.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def response(self) -> JSONResponse:
        content = body(self.message, self.type, self.code, self.param)
        return JSONResponse(status_code=self.status, content=content)


def body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def context_length_exceeded(prompt_tokens: int, limit: int) -> ApiError:
    return ApiError(400, f"This model's maximum context length is {limit} tokens "
                         f"(policy.max_total_sequence_length), and your prompt has {prompt_tokens} tokens: "
                         "no room for a completion. Please reduce the length of the messages.",
                    code="context_length_exceeded", param="messages")
