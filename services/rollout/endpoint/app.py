"""The HTTP side: FastAPI routes, the episode check on every call, error shapes, uvicorn on the worker's loop.

Routes (each also under /v1/... with the session in the `X-Flywheel-Session` header):

    POST /sessions/<key>/v1/chat/completions    chat.py
    POST /sessions/<key>/v1/completions         completions.py
    POST /sessions/<key>/v1/responses           responses.py
    GET  /sessions/<key>/v1/models              the policy, as one model

Bodies are read here (at most security.max_message_mb) and parsed by schemas.py, so malformed JSON, unknown
fields and wrong types are all answered 400 in OpenAI's error shape, never FastAPI's own.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.rollout.endpoint import chat as chat_route
from services.rollout.endpoint import completions as completions_route
from services.rollout.endpoint import responses as responses_route
from services.rollout.endpoint.errors import ApiError, bad_request, body
from services.rollout.endpoint.generation import observe
from services.rollout.endpoint.schemas import ChatRequest, CompletionRequest, ResponsesRequest, parse
from services.rollout.endpoint.sessions import Episode, Sessions

log = logging.getLogger("flywheel.rollout.endpoint")
SESSION_HEADER = "x-flywheel-session"


def make_app(sessions: Sessions, chat: chat_route.Chat, completions: completions_route.Completions,
             model_name: str, max_body_bytes: int) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def call(request: Request, key: str | None, route: str, handle) -> JSONResponse | StreamingResponse:
        started, status = time.perf_counter(), 200
        try:
            episode = sessions.authorize(key or request.headers.get(SESSION_HEADER), bearer(request))
            return await handle(episode, request)
        except ApiError as err:
            status = err.status
            return err.response()
        except Exception:  # noqa: BLE001 - one call's failure is its answer, never the server's end
            status = 500
            log.exception("endpoint %s call failed", route)
            failed = body("the server failed to answer this call", "server_error")
            return JSONResponse(status_code=500, content=failed)
        finally:
            observe(route, status, started)

    async def on_chat(episode: Episode, request: Request):
        req = parse(ChatRequest, await read_json(request, max_body_bytes))
        completion, _ = await chat.answer(episode, req)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(chat_route.stream(completion, include), media_type="text/event-stream")
        return JSONResponse(completion)

    async def on_completions(episode: Episode, request: Request):
        req = parse(CompletionRequest, await read_json(request, max_body_bytes))
        completion = await completions.answer(episode, req)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            events = completions_route.stream(completion, include)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(completion)

    async def on_responses(episode: Episode, request: Request):
        req = parse(ResponsesRequest, await read_json(request, max_body_bytes))
        return JSONResponse(await responses_route.answer(chat, episode, req))

    async def on_models(episode: Episode, request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "flywheel"}]})

    for path, method, route, handle in (("/chat/completions", "POST", "chat", on_chat),
                                        ("/completions", "POST", "completions", on_completions),
                                        ("/responses", "POST", "responses", on_responses),
                                        ("/models", "GET", "models", on_models)):
        by_path, by_header = routes(call, route, handle)
        app.add_api_route("/sessions/{key}/v1" + path, by_path, methods=[method])
        app.add_api_route("/v1" + path, by_header, methods=[method])
    return app


def routes(call, route: str, handle):
    """The route's two handlers: session key in the path, or in the X-Flywheel-Session header."""
    async def by_path(request: Request, key: str):
        return await call(request, key, route, handle)

    async def by_header(request: Request):
        return await call(request, None, route, handle)

    return by_path, by_header


def bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def read_json(request: Request, limit: int):
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, f"request body over {limit} bytes (security.max_message_mb)",
                           code="body_too_large")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None
