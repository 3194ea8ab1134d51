"""The engines behind the router: who is in rotation, how loaded each is, what each reported.

An engine leaves the rotation when a request to it fails at the network level or answers 5xx,
or when its ``/health`` fails; the health loop keeps probing it and puts it back on the first
good answer. All of this state is touched from the router's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx2

from events.schema import BlockHash
from router.config import EngineSpec
from router.pressure import Pressure

log = logging.getLogger("kv-router")


@dataclass
class EngineState:
    spec: EngineSpec
    healthy: bool = False
    """In rotation. Engines start out of it until their first good /health."""
    in_flight: int = 0
    """Requests of this router on the engine now."""
    engine_waiting: int = 0
    """Requests queued in the engine as its last /health said (others' traffic included)."""
    last_error: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    failures: int = 0
    pressure: Pressure = field(default_factory=Pressure)
    """This router's requests on the engine against its pool (router.pressure)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def load(self) -> int:
        """What the policies weigh: this router's requests on it (the router is the front door;
        the engine's own queue depth, seen once a health interval, is shown, not scored)."""
        return self.in_flight

    def begin(self, request_id: str, hashes: Sequence[BlockHash], gpu_blocks: int) -> None:
        """A request goes to the engine, ``gpu_blocks`` of its ``hashes`` predicted in its GPU tier."""
        self.in_flight += 1
        self.pressure.started(request_id, hashes, gpu_blocks)

    def first_token(self, request_id: str) -> None:
        """The engine sent the request's first token: its prompt is computed (router.pressure)."""
        self.pressure.prefilled(request_id)

    def end(self, request_id: str) -> None:
        """The request is done on the engine (finished, failed or given up)."""
        self.in_flight -= 1
        self.pressure.finished(request_id)

    def report(self, prompt_tokens: int, gpu: int, cpu: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.gpu_hit_tokens += gpu
        self.cpu_hit_tokens += cpu

    def take_out(self, why: str) -> None:
        if self.healthy:
            log.warning("engine %s out of rotation: %s", self.name, why)
        self.healthy, self.last_error = False, why
        self.failures += 1


class Fleet:
    def __init__(self, specs: tuple[EngineSpec, ...], client: httpx2.AsyncClient,
                 interval_s: float, timeout_s: float) -> None:
        self.engines = [EngineState(s) for s in specs]
        self.by_name = {e.name: e for e in self.engines}
        self._client = client
        self._interval_s = interval_s
        self._timeout_s = timeout_s

    def healthy(self) -> list[EngineState]:
        return [e for e in self.engines if e.healthy]

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.engines))

    async def run_health_checks(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self._interval_s)

    async def _check(self, engine: EngineState) -> None:
        try:
            resp = await self._client.get(f"{engine.spec.url}/health", timeout=self._timeout_s)
            body = resp.json() if resp.status_code == 200 else None
        except (httpx2.HTTPError, ValueError) as exc:
            engine.take_out(f"/health: {type(exc).__name__}: {exc}")
            return
        if not isinstance(body, dict) or body.get("status") != "ok":
            engine.take_out(f"/health answered {resp.status_code}")
            return
        if not engine.healthy:
            log.info("engine %s in rotation", engine.name)
        engine.healthy, engine.last_error = True, ""
        waiting = body.get("requests_waiting")
        engine.engine_waiting = waiting if isinstance(waiting, int) and waiting >= 0 else 0
        pool = body.get("gpu_blocks")  # our engines say; others do not (the view is used as is)
        engine.pressure.pool_blocks = pool if type(pool) is int and pool > 0 else 0
