"""The engine's OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions
(streamed as SSE or not), /v1/models, /health. Errors in OpenAI's shape (rpc.openai_protocol).

Like the gRPC servicer, this edge only converts: requests go to the EngineLoop, whose blocking
calls run in the thread pool. Chat messages are rendered with the model's chat template
(events.prompt), the same one kv-router renders to predict the cached prefix.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from engine.engine_loop import EngineLoop, RequestStream
from engine.errors import EngineError, EngineStopped, InvalidRequest
from engine.request import StepOutput
from engine.sampling import SamplingParams
from events.prompt import ChatMessage, ChatTemplate, PromptError
from rpc.openai_protocol import (
    REQUEST_ID_HEADER,
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    install_error_handlers,
    models_list,
    parse_body,
    sse,
    usage,
)

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
MAX_REQUEST_ID_CHARS = 128


def create_app(loop: EngineLoop, model_name: str, chat_template: ChatTemplate) -> FastAPI:
    app = FastAPI(title="kv-engine", summary="OpenAI-compatible API of a kvoffload engine",
                  docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.get("/health")
    def health() -> dict[str, Any]:
        sched = loop.core.scheduler
        pool = loop.core.kv.pools[0]  # read from this thread while the loop runs: a moment's figures
        return {"status": "ok", "engine_id": loop.core.config.engine_id, "model": model_name,
                "requests_running": len(sched.running), "requests_waiting": len(sched.waiting),
                "gpu_blocks": pool.num_blocks, "gpu_blocks_free": pool.num_free_blocks,
                "gpu_blocks_cached": len(pool.hash_to_block),
                "prefix_hold": sched.holds.enabled,
                "prefix_holds": sched.holds.num_held, "prefix_holds_dropped": sched.holds.num_dropped}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return models_list([model_name])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await request.body())
        _check_model(req.model, model_name)
        params = _sampling(req, req.max_tokens if req.max_tokens is not None else 16)
        return await _respond(loop, req.single_prompt(), params, request, req.stream,
                              req.include_usage, model_name, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await request.body())
        _check_model(req.model, model_name)
        try:
            prompt = chat_template.render([ChatMessage(m.role, m.text()) for m in req.messages])
        except PromptError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        params = _sampling(req, req.new_tokens)
        return await _respond(loop, prompt, params, request, req.stream, req.include_usage,
                              model_name, chat=True)

    return app




def _check_model(asked: str | None, served: str) -> None:
    if asked is not None and asked != served:
        raise OpenAIError(404, f"the model {asked!r} does not exist; this engine serves {served!r}",
                          "not_found_error", "model", "model_not_found")


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=req.stops(),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos)


def _request_id(request: Request, chat: bool) -> str:
    rid = request.headers.get(REQUEST_ID_HEADER)
    if rid is None:
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if not 0 < len(rid) <= MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise OpenAIError(400, f"{REQUEST_ID_HEADER} must be 1-{MAX_REQUEST_ID_CHARS} printable characters")
    return rid


async def _respond(loop: EngineLoop, prompt: str | list[int], params: SamplingParams, request: Request,
                   stream: bool, include_usage: bool, model: str, *, chat: bool) -> Response:
    rid = _request_id(request, chat)
    try:
        run: RequestStream = await run_in_threadpool(loop.submit, prompt, params, rid)
    except InvalidRequest as exc:
        raise OpenAIError(400, str(exc)) from exc
    except EngineError as exc:
        raise OpenAIError(503, str(exc), "service_unavailable") from exc
    shape = _Shape(rid, model, chat)
    if stream:
        return StreamingResponse(_stream(loop, run, shape, include_usage), media_type="text/event-stream")
    try:
        outs: list[StepOutput] = await run_in_threadpool(list, run)
    except EngineError as exc:
        raise _served_error(exc) from exc
    return JSONResponse(shape.whole(outs, run.num_prompt_tokens))


async def _stream(loop: EngineLoop, run: RequestStream, shape: _Shape, include_usage: bool) -> AsyncIterator[bytes]:
    last: StepOutput | None = None
    n = 0
    try:
        if shape.chat:
            yield sse(shape.chunk({"role": "assistant", "content": ""}, None))
        async for out in iterate_in_threadpool(iter(run)):
            last, n = out, n + len(out.new_token_ids)
            reason = FINISH_REASONS.get(out.finish_reason or "") if out.finished else None
            if out.new_token_ids or reason:  # a chunk per token, its text possibly held back
                yield sse(shape.chunk(out.new_text, reason))
        if include_usage and last is not None:
            yield sse({**shape.chunk(None, None), "choices": [],
                       "usage": usage(run.num_prompt_tokens, n, last.num_cached_tokens,
                                      last.num_external_cached_tokens)})
        yield SSE_DONE
    except EngineError as exc:
        yield sse(_served_error(exc).body())
    finally:
        if last is None or not last.finished:  # the client went away: free the engine
            loop.abort(run.request_id)


def _served_error(exc: EngineError) -> OpenAIError:
    """A request the engine took and could not finish: it stopped (503, retry elsewhere) or failed."""
    if isinstance(exc, EngineStopped):
        return OpenAIError(503, str(exc), "service_unavailable")
    return OpenAIError(500, str(exc), "internal_error")


class _Shape:
    """Response bodies of one request, completion or chat."""

    def __init__(self, rid: str, model: str, chat: bool) -> None:
        self.rid, self.model, self.chat, self.created = rid, model, chat, int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, content: str | dict[str, str] | None, reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = content if isinstance(content, dict) else ({} if content is None else {"content": content})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def whole(self, outs: list[StepOutput], num_prompt_tokens: int) -> dict[str, Any]:
        text = "".join(o.new_text for o in outs)
        last = outs[-1] if outs else None
        reason = FINISH_REASONS.get(last.finish_reason or "", "abort") if last else "abort"
        n = sum(len(o.new_token_ids) for o in outs)
        u = usage(num_prompt_tokens, n, last.num_cached_tokens if last else 0,
                  last.num_external_cached_tokens if last else 0)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": u}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": u}
