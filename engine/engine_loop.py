"""Runs an EngineCore on its own thread so many callers (gRPC streams) can share it.

Callers talk to the loop only through commands on a queue; the core is touched by the loop
thread alone, so the core needs no locks. Each request gets a stream of ``StepOutput``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.engine_core import EngineCore
from engine.errors import EngineError, EngineStopped
from engine.request import StepOutput
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

_END = object()


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished output."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._queue: queue.Queue[Any] = queue.Queue()

    def _put(self, item: Any) -> None:
        self._queue.put(item)

    def __iter__(self) -> Iterator[StepOutput]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass
class _Command:
    run: Callable[[EngineCore], Any]
    future: Future[Any]


class EngineLoop:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = threading.Event()
        self._accepting = threading.Lock()
        """Held to queue a command and to refuse the rest at the end: no command is left unanswered."""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_steps = 0

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the step running now; requests not finished get an EngineStopped."""
        self._stopped.set()
        self._inbox.put(_Command(lambda core: None, Future()))
        self._thread.join(timeout_s)

    def _call(self, fn: Callable[[EngineCore], Any]) -> Any:
        fut: Future[Any] = Future()
        with self._accepting:
            if self._stopped.is_set():
                raise EngineStopped("the engine is shutting down")
            self._inbox.put(_Command(fn, fut))
        return fut.result()

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Validate and queue a request (InvalidRequest is raised here, in the caller)."""

        def add(core: EngineCore) -> RequestStream:
            req = core.add_request(prompt, params, request_id)
            stream = RequestStream(req.request_id, len(req.prompt_token_ids))
            self._streams[req.request_id] = stream
            return stream

        result: RequestStream = self._call(add)
        return result

    def abort(self, request_id: str) -> None:
        def abort(core: EngineCore) -> None:
            core.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._put(_END)

        with contextlib.suppress(EngineStopped):  # stopped: the loop ends every open stream itself
            self._call(abort)

    def reset_prefix_cache(self) -> bool:
        result: bool = self._call(lambda core: core.reset_prefix_cache())
        return result

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self.core.has_unfinished:
                try:
                    self._execute(self._inbox.get(timeout=0.5))
                except queue.Empty:
                    continue
            while True:
                try:
                    self._execute(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if self.core.has_unfinished and not self._stopped.is_set():
                self._step()
        for stream in self._streams.values():
            stream._put(EngineStopped("the engine shut down before the request finished"))
        self._streams.clear()
        # A caller may have queued a command after the last one this loop ran: it must not
        # wait for an answer forever (a server thread blocked there would hold up the exit).
        with self._accepting:
            while True:
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    return
                cmd.future.set_exception(EngineStopped("the engine is shutting down"))

    def _execute(self, cmd: _Command) -> None:
        try:
            cmd.future.set_result(cmd.run(self.core))
        except Exception as exc:
            cmd.future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:  # a bug or device error: fail the requests, keep the process
            log.exception("engine step failed")
            for rid, failed in list(self._streams.items()):
                failed._put(EngineError(f"engine step failed: {exc}"))
                self.core.abort(rid)
            self._streams.clear()
            return
        self.num_steps += 1
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                stream._put(_END)
                del self._streams[out.request_id]
