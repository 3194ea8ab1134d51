"""kv-bridge as a real subprocess for tests, and a tiny log writer that appends records to Redis
exactly as the offload daemon does (events.records + events.logkeys), so the bridge can be
tested before and without the daemon.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from events.logkeys import LogKeys
from events.records import RECORD_FIELD, encode_record, entry_id
from events.schema import BlockRemoved, BlockStored, Event, LogRecord
from tests.support.child_process import REPO, get_json, spawn, stop_process, wait_ready
from tests.support.redis_proc import free_port

REPO_ROOT = REPO


class BridgeProcess:
    """``python -m bridge.main`` on free loopback ports; logs go to ``workdir``."""

    def __init__(
        self, redis_url: str, workdir: Path, *args: str, namespace: str = "default"
    ) -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.namespace = namespace
        self.args = list(args)
        self.pub_port = free_port()
        self.replay_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def pub(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"bridge-{self.runs}.log"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "bridge.main",
            "--redis-url", self.redis_url, "--namespace", self.namespace,
            "--pub", f"tcp://127.0.0.1:{self.pub_port}",
            "--replay", f"tcp://127.0.0.1:{self.replay_port}",
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
            *self.args,
        ]

    def start(self, timeout_s: float = 15.0, wait_healthy: bool = True) -> None:
        self.runs += 1
        self.proc = spawn(self.command(), self.log_path, append=False)
        if wait_healthy:
            self.wait_healthy(timeout_s)

    def health(self) -> tuple[int, dict[str, Any]]:
        status, body = get_json(f"http://127.0.0.1:{self.metrics_port}/healthz", 1.0)
        return status, body

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.read().decode()

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        assert self.proc is not None, "start() first"
        wait_ready(self.proc, lambda: self.health()[0] == 200, name="kv-bridge", timeout_s=timeout_s,
                   output=self.output)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, kill: bool = False, timeout_s: float = 10.0) -> int:
        code = stop_process(self.proc, signal.SIGKILL if kill else signal.SIGTERM, timeout_s)
        self.proc = None
        return code


class LogWriter:
    """Appends LogRecords the way offloadd does: XADD ``{offset}-0`` + SET head in one MULTI."""

    def __init__(self, client: Any, namespace: str = "default") -> None:
        self.client = client
        self.keys = LogKeys(namespace)
        self.offset = int(client.get(self.keys.head) or 0)

    def append(self, source: str, events: Sequence[Event], *, incarnation: int = 1,
               source_seq: int = 0, ts: float | None = None) -> LogRecord:
        self.offset += 1
        record = LogRecord(
            self.offset, source, incarnation, source_seq, time.time() if ts is None else ts,
            tuple(events),
        )
        self.write(record)
        return record

    def write(self, record: LogRecord) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.log, {RECORD_FIELD: encode_record(record)}, id=entry_id(record.offset))
        pipe.set(self.keys.head, record.offset)
        pipe.execute()
        self.offset = record.offset


class FleetSimulator:
    """Plausible records of several engines: chained stores, evictions, CPU copies.

    Deterministic per seed; each engine keeps its own incarnation and seq, like real sources.
    """

    def __init__(self, sources: Sequence[str], seed: int = 0, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.sources = list(sources)
        self.seqs = dict.fromkeys(sources, 0)
        self.resident: dict[tuple[str, str], list[int]] = {}
        self.next_hash = 1000

    def events_for(self, source: str, blocks_per_event: int = 3) -> list[Event]:
        rng, bs = self.rng, self.block_size
        medium = "GPU" if rng.random() < 0.7 else "CPU"
        held = self.resident.setdefault((source, medium), [])
        if held and rng.random() < 0.3:
            victims = held[-rng.randint(1, min(3, len(held))):]
            del held[-len(victims):]
            return [BlockRemoved(tuple(victims), medium)]  # type: ignore[arg-type]
        parent = held[-1] if held and rng.random() < 0.5 else None
        hashes = tuple(range(self.next_hash, self.next_hash + blocks_per_event))
        self.next_hash += blocks_per_event
        held.extend(hashes)
        tokens = tuple(rng.randrange(32000) for _ in range(bs * blocks_per_event))
        return [BlockStored(hashes, parent, tokens, bs, medium)]  # type: ignore[arg-type]

    def records(self, count: int) -> Iterator[tuple[str, list[Event], int]]:
        """``(source, events, source_seq)`` for ``count`` batches, sources interleaved at random."""
        for _ in range(count):
            source = self.rng.choice(self.sources)
            self.seqs[source] += 1
            yield source, self.events_for(source), self.seqs[source]

    def write(self, writer: LogWriter, count: int) -> list[LogRecord]:
        return [
            writer.append(src, events, source_seq=seq) for src, events, seq in self.records(count)
        ]
