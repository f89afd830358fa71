"""The HTTP side: OpenAI's routes, answer shapes and errors, over Starlette.

    GET  /v1/models                  the one model served (its id is what `model` must name)
    POST /v1/chat/completions        a chat completion; `"stream": true` sends it as server-sent events
    GET  /health                     200 once the model is loaded (no key needed: for load balancers)

Every request first passes guard.py (Host, Origin, Content-Type). Every error is OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with a 4xx status for anything the request did wrong (a bad
body, unknown model, missing key, too long for the context); a 500 only for a bug, with its traceback in the run
dir's log. With serve.api_key set, /v1/* needs `Authorization: Bearer <key>` (401 otherwise, compared in
constant time).

The event loop only moves bytes: the body is read up to serve.max_body_mib as it arrives (chunked or not: the
bytes read are counted, not the Content-Length promised), and parsing, validation and tokenization run on a
thread of their own, so one large or slow request never holds up /health or another client's stream.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..config import InferConfig
from ..config.units import MIB
from .engine import Engine, Job
from .guard import Guard, Hosts
from .protocol import ApiError, ChatRequest, parse_chat, parse_json

log = logging.getLogger("glmtune.serve")
# After a body over the cap, the rest is read and dropped for up to this long (seconds) before the 413 goes
# out: a client that sends its whole body before reading (most do) then gets the 413 instead of a reset
# connection. Nothing is kept, so memory stays flat; a client still sending after that is cut off.
DRAIN_S = 2.0


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class Service:
    """What the routes share: the engine, the served model's id, the key, the server's infer.* defaults."""

    def __init__(self, engine: Engine, model_id: str, api_key: str | None, infer: InferConfig, max_body: int):
        self.engine, self.model_id, self.api_key, self.infer = engine, model_id, api_key, infer
        self.max_body, self.created = max_body, int(time.time())  # bytes
        self.vision = bool(getattr(engine.model.config, "vision_config", None))
        # One thread: requests are parsed one at a time, in arrival order (the tokenizer is not shared between
        # threads beyond the engine's decoding), and never on the event loop.
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="glmtune-serve-parse")

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(
                401,
                "Incorrect or missing API key: send the header `Authorization: Bearer <key>` with "
                "the key the server was started with (serve.api_key)",
                None,
                "invalid_api_key",
            )

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.model_id, "object": "model", "created": self.created, "owned_by": "glmtune"}],
            }
        )

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id})

    async def chat(self, request: Request) -> Response:
        self.check_key(request)
        raw = await read_body(request, self.max_body)
        loop = asyncio.get_running_loop()
        chat = await loop.run_in_executor(self.parser, self.parse, raw)
        job = self.engine.admit(chat, loop)
        self.engine.submit(job)
        reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if chat.stream:
            return StreamingResponse(
                self.sse(job, reply_id, created), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            while True:  # the deltas add up to the final content, which "done" carries whole
                kind, result = await job.events.get()
                if kind == "error":
                    raise result
                if kind == "done":
                    break
        finally:
            job.cancelled = True  # a no-op once done; stops the row if this handler was cancelled
        message = {"role": "assistant", "content": result["content"]}
        if result["tool_call"]:
            message["tool_calls"] = [result["tool_call"].openai()]
        return JSONResponse(
            {
                "id": reply_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_id,
                "system_fingerprint": None,
                "choices": [
                    {"index": 0, "message": message, "logprobs": None, "finish_reason": result["finish_reason"]}
                ],
                "usage": usage(result),
            }
        )

    def parse(self, raw: bytearray) -> ChatRequest:
        """The body checked whole (parser thread); ApiError names the first thing at fault."""
        body = parse_json(raw)
        if isinstance(body, dict) and not isinstance(body.get("model"), str):
            raise ApiError(400, f"model is required: this server serves `{self.model_id}`", "model", "missing_model")
        if isinstance(body, dict) and body.get("model") != self.model_id:
            raise ApiError(
                404,
                f"The model `{body['model'][:200]}` does not exist; this server serves "
                f"`{self.model_id}` (GET /v1/models)",
                "model",
                "model_not_found",
            )
        return parse_chat(body, self.infer, self.engine.tokenizer, self.vision)

    async def sse(self, job: Job, reply_id: str, created: int) -> AsyncIterator[str]:
        """The reply as chat.completion.chunk events: the role, content deltas, a tool call, the finish."""

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            body = {
                "id": reply_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_id,
                "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                **extra,
            }
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    yield chunk({"content": payload})
                    continue
                if kind == "error":  # the status line is sent already: the error goes in the stream
                    yield f"data: {json.dumps(payload.body(), ensure_ascii=False)}\n\n"
                    break
                if payload["tool_call"]:
                    yield chunk({"tool_calls": [payload["tool_call"].openai(index=0)]})
                yield chunk({}, payload["finish_reason"])
                if job.request.include_usage:
                    yield (
                        "data: "
                        + json.dumps(
                            {
                                "id": reply_id,
                                "object": "chat.completion.chunk",
                                "created": created,
                                "model": self.model_id,
                                "choices": [],
                                "usage": usage(payload),
                            }
                        )
                        + "\n\n"
                    )
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True  # the client disconnected mid-stream: its row stops at the next token


def usage(result: dict) -> dict:
    return {
        "prompt_tokens": result["prompt_tokens"],
        "completion_tokens": result["completion_tokens"],
        "total_tokens": result["prompt_tokens"] + result["completion_tokens"],
    }


async def read_body(request: Request, limit: int) -> bytearray:
    """The body, or a 413 once more than `limit` bytes have arrived (or are announced)."""
    size = request.headers.get("content-length", "")
    chunks = request.stream()
    body = bytearray()
    if not (size.isdigit() and int(size) > limit):
        async for chunk in chunks:
            body += chunk
            if len(body) > limit:
                break
        else:
            return body
    del body  # what was read of a refused body goes now, not after the drain
    deadline = time.monotonic() + DRAIN_S
    async for _ in chunks:
        if time.monotonic() > deadline:
            break
    raise ApiError(
        413,
        f"the request body is over {limit / MIB:g} MiB (serve.max_body_mib) — send a smaller "
        "image (e.g. JPEG) or raise serve.max_body_mib",
        None,
        "request_too_large",
    )


async def api_error(request: Request, err: ApiError) -> Response:
    return error_response(err)


async def http_error(request: Request, err: HTTPException) -> Response:
    """Starlette's own 404 / 405, in OpenAI's shape."""
    what = {
        404: f"no route {request.url.path} (the API is under /v1: /v1/chat/completions, /v1/models)",
        405: f"{request.method} is not allowed on {request.url.path}",
    }.get(err.status_code, str(err.detail))
    return error_response(ApiError(err.status_code, what, None, {404: "not_found"}.get(err.status_code)))


async def server_error(request: Request, err: Exception) -> Response:
    log.error("unexpected error on %s", request.url.path, exc_info=err)
    return error_response(ApiError(500, f"internal error: {type(err).__name__}: {err}", None, None, "server_error"))


def make_app(service: Service, hosts: Hosts, allow_origins: list[str]):
    routes = [
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/chat/completions", service.chat, methods=["POST"]),
        Route("/health", service.health, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error}
    )
    return Guard(app, hosts, allow_origins)
