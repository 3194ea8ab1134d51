"""The OpenAI-compatible HTTP protocol that engines and kv-router both speak: request bodies,
the error shape, usage with cached tokens, SSE framing. One owner, so the front door and the
engine behind it never disagree about a field.

Extensions beyond OpenAI's fields, as vLLM has them: ``ignore_eos``, ``stop_token_ids``; in
``usage.prompt_tokens_details`` ``gpu_cached_tokens`` and ``cpu_cached_tokens`` beside
``cached_tokens`` (their sum). Clients ignore keys they do not know.
"""

from __future__ import annotations

import json
import time
from typing import Any, Final, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

SSE_DONE: Final = b"data: [DONE]\n\n"
REQUEST_ID_HEADER: Final = "x-request-id"
"""A caller-chosen request id (the router sets it) used as the engine's request id."""


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of prompts is refused."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(x, int) for x in p):
            return [int(x) for x in p]  # type: ignore[arg-type]
        if len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise OpenAIError(400, "give one prompt per request (a string or a list of token ids)",
                          param="prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(400, f"only text content parts are supported, got {part.type!r}",
                                  param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: bytes) -> M:
    """The request body as ``model``; anything else is an OpenAIError 400 naming the field."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    if b"\\ud" in body.lower():  # an escaped surrogate: JSON allows a lone one, UTF-8 does not
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise OpenAIError(400, "the body holds a lone UTF-16 surrogate escape "
                                   f"({exc.object[exc.start:exc.end]!a}); text must be valid Unicode") from exc
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise OpenAIError(400, f"{where}: {first['msg']}", param=where or None) from exc
    if isinstance(parsed, _Sampling) and parsed.n != 1:
        raise OpenAIError(400, "n must be 1 (one choice per request)", param="n")
    return parsed


def usage(prompt_tokens: int, completion_tokens: int, gpu_cached: int, cpu_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gpu_cached + cpu_cached,
                                  "gpu_cached_tokens": gpu_cached, "cpu_cached_tokens": cpu_cached},
    }


def cached_from_usage(body: Any) -> tuple[int, int, int] | None:
    """``(prompt_tokens, gpu_cached, cpu_cached)`` from a response or chunk with usage, else None.
    Counts that are not non-negative integers (another server's idea of usage) read as 0."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = {}
    gpu, cpu = _count(details.get("gpu_cached_tokens")), _count(details.get("cpu_cached_tokens"))
    if gpu is None or cpu is None:
        gpu, cpu = _count(details.get("cached_tokens")) or 0, 0
    return _count(u.get("prompt_tokens")) or 0, gpu, cpu


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def models_list(names: list[str]) -> dict[str, Any]:
    now = int(time.time())
    return {"object": "list", "data": [
        {"id": n, "object": "model", "created": now, "owned_by": "kvoffload"} for n in names]}


def install_error_handlers(app: FastAPI) -> None:
    """OpenAIError, FastAPI's own errors (unknown path, wrong method) and any other exception
    (500), in OpenAI's shape; a client gone before its body arrived, quietly."""

    async def openai_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(OpenAIError(exc.status_code, str(exc.detail), kind).body(),
                            status_code=exc.status_code)

    async def client_gone(_request: Request, exc: Exception) -> Response:
        # The client left while its body was read: nobody gets this answer, and a slow-body
        # flood must not fill the log with one traceback per connection.
        return Response(status_code=400)

    async def internal_error(_request: Request, exc: Exception) -> Response:
        # Still logged with its traceback by the server; the client gets the API's shape.
        return JSONResponse(OpenAIError(500, f"internal error ({type(exc).__name__})",
                                        "internal_server_error").body(), status_code=500)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, internal_error)
