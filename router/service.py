"""The router's work per request: tokenize and hash the prompt once, choose an engine, forward
the request, retry elsewhere while nothing has reached the client, and compare the cached
prefix the engine reports with the predicted one (router.truth)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx2
from fastapi.responses import Response, StreamingResponse

from events.hashing import BlockHasher, int_array
from events.prompt import (
    ChatMessage,
    ChatTemplate,
    PromptError,
    load_chat_template,
)
from events.schema import BlockHash
from events.tokenizer import Tokenizer, load_tokenizer
from router.config import RouterConfig
from router.fleet import EngineState, Fleet
from router.follower import Follower
from router.policy import Chooser, Decision, prefix_run
from router.sse import SseEvent, sse_events
from router.truth import Truth
from rpc.openai_protocol import (
    REQUEST_ID_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    cached_from_usage,
    sse,
)

log = logging.getLogger("kv-router")

ENGINE_HEADER = "x-kv-engine"
REASON_HEADER = "x-kv-route-reason"
PREDICTED_HEADER = "x-kv-predicted-cached-tokens"
OFF_LOOP_MIN_SIZE = 16_384
"""Prompts of this many characters or ids and more (~4k tokens: ~0.3 ms to tokenize and hash
here) are prepared on the hashing thread; shorter ones on the loop."""


class EngineFailed(Exception):
    """The engine did not answer (network error or 5xx) before anything reached the client."""


@dataclass
class Timings:
    """Decision times (tokenize + hash + choose): totals since start, and the most recent ones."""

    count: int = 0
    total_s: float = 0.0
    recent: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.recent.append(seconds)
        if len(self.recent) > 10_000:
            del self.recent[:5_000]


class Router:
    def __init__(self, config: RouterConfig, client: httpx2.AsyncClient, follower: Follower | None) -> None:
        self.config = config
        self.client = client
        self.follower = follower
        self.fleet = Fleet(config.engines, client, config.health_interval_s, config.health_timeout_s)
        self.chooser = Chooser(config)
        self.truth = Truth()
        self.timings = Timings()
        self.hasher = BlockHasher(config.hash_seed, config.block_size, config.hash_algo)
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="router-hash")
        """Tokenizing and hashing a prompt, off the event loop (it relays the other streams)."""
        self.tokenizer: Tokenizer = load_tokenizer(config.model_dir)
        self.chat: ChatTemplate = load_chat_template(config.model_dir) if config.model_dir else ChatTemplate()
        self.retries = 0
        self._ids = itertools.count()
        if follower is not None:
            follower.stored_listener = self._stored
        self._prefix = f"rt{os.getpid()}-{int(time.time())}"

    # -- prompt -> hashes --------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            try:
                text: str | list[int] = self.chat.render([ChatMessage(m.role, m.text()) for m in req.messages])
            except PromptError as exc:
                raise OpenAIError(400, str(exc), param="messages") from exc
        else:
            text = req.single_prompt()
        return text if isinstance(text, list) else self.encode(text)

    def hashes(self, token_ids: list[int]) -> list[BlockHash]:
        """The blocks an engine can reuse: every full block but the one holding the last token;
        none when an id is negative (an engine refuses such a prompt: nothing to reuse)."""
        bs = self.config.block_size
        n = max(len(token_ids) - 1, 0) // bs
        if n == 0:
            return []
        ids = int_array(token_ids[: n * bs])  # checked and hashed as one array (no second pass)
        if ids is None:  # not all int64: hashed as given (cbor2)
            return [] if min(token_ids) < 0 else self.hasher.wire_hashes(token_ids[: n * bs])
        return [] if int(ids.min()) < 0 else self.hasher.wire_hashes(ids)

    async def off_loop(self, prepare: Callable[[], list[BlockHash]], size: int) -> list[BlockHash]:
        """Run ``prepare`` (tokenize and hash a prompt of ``size`` characters or ids) on the
        hashing thread, so that the event loop relays the other requests' streams meanwhile; a
        prompt below OFF_LOOP_MIN_SIZE inline, where the thread's wake-up costs more than the
        work (DECISIONS 54)."""
        if size < OFF_LOOP_MIN_SIZE:
            return prepare()
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, prepare)

    def close(self) -> None:
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    def decide(self, hashes: list[BlockHash], tried: set[str], *, grpc: bool = False) -> Decision | None:
        """``grpc``: only engines with a Generate target."""
        candidates = [e for e in self.fleet.healthy() if e.name not in tried and (e.spec.grpc or not grpc)]
        if not candidates:
            return None
        if self.follower is None:
            return self.chooser.choose(candidates, hashes, None)
        with self.follower.reading() as state:
            return self.chooser.choose(candidates, hashes, state)

    def _stored(self, source: str, hashes: Sequence[int]) -> None:
        """Blocks an engine stored, as the stream shows them (router.pressure)."""
        for engine in self.fleet.engines:
            if engine.spec.source == source:
                engine.pressure.saw_stored(hashes)  # type: ignore[arg-type]  # wire ints

    def record(self, decision: Decision) -> dict[str, Any]:
        """A decision under a new request id, kept for the truth and the fleet page."""
        rid = f"{self._prefix}-{next(self._ids)}"
        bs = self.config.block_size
        predicted = (decision.gpu_blocks + decision.cpu_blocks) * bs
        if decision.at_risk_blocks:
            log.info("%s: %d GPU blocks of the view on %s expected evicted before the admission; predicting %d",
                     rid, decision.at_risk_blocks, decision.engine.name, decision.gpu_blocks)
        return self.truth.decided(rid, decision.engine.name, decision.reason, predicted,
                                  decision.at_risk_blocks * bs)

    def _predicted_now(self, engine: EngineState, hashes: list[BlockHash]) -> int:
        if self.follower is None:
            return 0
        with self.follower.reading() as state:
            if state is None:
                return 0
            g, c = prefix_run(state, hashes, engine)
            # Blocks the engine stored and evicted again before the request ended count too: it
            # reused them, the hashes agree (not a hash_mismatch).
            g = max(g, engine.pressure.stored_run(state.resident(engine.spec.source, "GPU"), hashes))
        return (g + c) * self.config.block_size

    # -- forwarding --------------------------------------------------------------------------

    async def route(self, path: str, body: dict[str, Any],
                    req: CompletionRequest | ChatCompletionRequest) -> Response:
        start = time.perf_counter()
        hashes = await self.off_loop(lambda: self.hashes(self.prompt_ids(req)), _prompt_size(req))
        wants_usage = req.include_usage
        if req.stream:  # the router reads the engine's usage chunk; the client gets it if asked
            body = {**body, "stream_options": {"include_usage": True}}
        content = json.dumps(body).encode()
        tried: set[str] = set()
        errors: list[str] = []
        first = True
        for _attempt in range(self.config.max_attempts):
            decision = self.decide(hashes, tried)
            if decision is None:
                break
            if first:
                self.timings.add(time.perf_counter() - start)
                first = False
            else:
                self.retries += 1
            engine = decision.engine
            tried.add(engine.name)
            entry = self.record(decision)
            engine.begin(entry["request_id"], hashes, decision.gpu_blocks)
            try:
                if req.stream:
                    return await self._stream(engine, path, content, entry["request_id"], entry, hashes, wants_usage)
                return await self._whole(engine, path, content, entry["request_id"], entry, hashes)
            except (httpx2.TransportError, EngineFailed) as exc:
                engine.end(entry["request_id"])
                why = f"{type(exc).__name__}: {exc}"
                engine.take_out(why)
                errors.append(f"{engine.name}: {why}")
                entry["reason"] += " (failed, retried)" if len(tried) < self.config.max_attempts else " (failed)"
        detail = "; ".join(errors) or "no engine is in rotation"
        raise OpenAIError(503, f"no engine could take the request: {detail}", "service_unavailable")

    def _headers(self, rid: str) -> dict[str, str]:
        return {"content-type": "application/json", REQUEST_ID_HEADER: rid}

    @staticmethod
    def _route_headers(entry: dict[str, Any]) -> dict[str, str]:
        """Where the request went and why, for clients that want to see it (the demo does)."""
        return {ENGINE_HEADER: entry["engine"], REASON_HEADER: entry["reason"],
                PREDICTED_HEADER: str(entry["predicted_cached_tokens"]), REQUEST_ID_HEADER: entry["request_id"]}

    async def _whole(self, engine: EngineState, path: str, content: bytes, rid: str,
                     entry: dict[str, Any], hashes: list[BlockHash]) -> Response:
        resp = await self.client.post(engine.spec.url + path, content=content, headers=self._headers(rid),
                                      timeout=self.config.request_timeout_s)
        if resp.status_code >= 500:
            raise EngineFailed(f"answered {resp.status_code}: {resp.text[:200]}")
        engine.end(entry["request_id"])
        if resp.status_code == 200:
            self._report(engine, entry, hashes, _json(resp.content))
        return Response(resp.content, resp.status_code, media_type="application/json",
                        headers=self._route_headers(entry))

    async def _stream(self, engine: EngineState, path: str, content: bytes, rid: str,
                      entry: dict[str, Any], hashes: list[BlockHash], wants_usage: bool) -> Response:
        request = self.client.build_request("POST", engine.spec.url + path, content=content,
                                            headers=self._headers(rid), timeout=self.config.request_timeout_s)
        resp = await self.client.send(request, stream=True)
        if resp.status_code != 200:
            body = await resp.aread()
            await resp.aclose()
            if resp.status_code >= 500:
                raise EngineFailed(f"answered {resp.status_code}: {body[:200]!r}")
            engine.end(entry["request_id"])
            return Response(body, resp.status_code, media_type="application/json",
                            headers=self._route_headers(entry))
        events = sse_events(resp.aiter_bytes())
        held: list[SseEvent] = []
        try:  # hold what comes before the first output: the engine may still die in the prefill
            async for ev in events:
                held.append(ev)
                if ev.carries_output:
                    engine.first_token(entry["request_id"])
                    break
            else:
                raise EngineFailed("the stream ended before any output")
        except BaseException:
            await resp.aclose()
            raise
        return StreamingResponse(self._relay(engine, resp, events, held, entry, hashes, wants_usage),
                                 media_type="text/event-stream", headers=self._route_headers(entry))

    async def _relay(self, engine: EngineState, resp: httpx2.Response, events: AsyncIterator[SseEvent],
                     held: list[SseEvent], entry: dict[str, Any], hashes: list[BlockHash],
                     wants_usage: bool) -> AsyncIterator[bytes]:
        try:
            for ev in held:
                if self._pass(engine, ev, entry, hashes, wants_usage):
                    yield ev.raw
            async for ev in events:
                if self._pass(engine, ev, entry, hashes, wants_usage):
                    yield ev.raw
        except httpx2.TransportError as exc:  # tokens already went out: say so, in OpenAI's shape
            engine.take_out(f"stream broke: {exc}")
            yield sse(OpenAIError(502, f"engine {engine.name} failed mid-stream: {exc}", "engine_error").body())
        finally:
            engine.end(entry["request_id"])
            await resp.aclose()

    def _pass(self, engine: EngineState, ev: SseEvent, entry: dict[str, Any], hashes: list[BlockHash],
              wants_usage: bool) -> bool:
        if isinstance(ev.data, dict) and ev.data.get("usage"):
            self._report(engine, entry, hashes, ev.data)
        return wants_usage or not ev.is_usage_only

    def _report(self, engine: EngineState, entry: dict[str, Any], hashes: list[BlockHash], body: Any) -> None:
        got = cached_from_usage(body)
        if got is not None:
            self.report(engine, entry, hashes, *got)

    def report(self, engine: EngineState, entry: dict[str, Any], hashes: list[BlockHash],
               prompt_tokens: int, gpu: int, cpu: int) -> None:
        """The engine's account of a finished request: its load figures and the prediction's truth."""
        engine.report(prompt_tokens, gpu, cpu)
        outcome = self.truth.reported(entry, gpu + cpu, self._predicted_now(engine, hashes))
        if outcome != "agree":
            log.info("prediction %s for %s on %s: predicted %s cached tokens, engine reused %d",
                     outcome, entry["request_id"], engine.name, entry["predicted_cached_tokens"], gpu + cpu)


def _prompt_size(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Characters or token ids of the prompt, before tokenizing."""
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages)
    return len(req.prompt) if isinstance(req.prompt, (str, list)) else 0


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None
