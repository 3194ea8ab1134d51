"""The checkpoint export in a forked child: the state as of the fork, while the parent goes on
changing it; a child that dies is a failed export, not a short checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from events.checkpoint import Manifest, decode_snapshot
from events.checkpoint_cut import Cuts, Piece, fences
from events.checkpoint_delta import tails
from events.schema import BlockStored, LogRecord
from events.state import CacheState
from offloadd.log.forked_export import ExportFailed, export_pieces
from tests.support.child_process import REPO
from tests.support.offloadd_proc import DaemonProcess
from tests.support.synthetic_engine import SyntheticPublisher, SyntheticStorer


def _state(n: int) -> CacheState:
    state = CacheState()
    for i in range(1, n + 1):
        state.apply(LogRecord(i, "engine-a", 1, i, 0.0, (BlockStored((i,), None, (1, 2), 2, "GPU"),)))
    return state


@pytest.mark.parametrize("fork", [True, False])
def test_the_chunks_are_the_state_at_the_start_while_the_parent_moves_on(fork: bool) -> None:
    state = _state(3000)
    want, sources = CacheState.from_snapshot(state.export()), fences(state)

    async def run() -> list[Piece]:
        got = []
        parts = tails(state, {}, set(), copy=False)
        async for chunk in export_pieces(parts, Cuts(500, 1, 500), {}, set(), fork):
            got.append(chunk)
            # The parent applies more records meanwhile; the export is of the state at its start
            # (the child's copy, or the blocks copied before the first chunk).
            n = state.offset + 1
            state.apply(LogRecord(n, "engine-a", 1, n, 0.0, (BlockStored((n,), None, (1, 2), 2, "GPU"),)))
        return got

    chunks = asyncio.run(run())
    assert len(chunks) == 6
    manifest = Manifest("x", want.offset, "e", 0.0, (0,), 0, 2, tuple(c.address for c in chunks), sources)
    assert CacheState.from_snapshot(decode_snapshot(manifest, [c.data for c in chunks])) == want
    assert state.offset == 3006


def _children() -> list[int]:
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as fp:
        return [int(p) for p in fp.read().split()]


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs Linux /proc")
def test_a_child_killed_midway_fails_the_export() -> None:
    """kill -9 of the exporting child after its first chunk: ExportFailed, nothing more read."""

    before = set(_children())  # a session's Redis may be a child of this process too

    async def run() -> int:
        n = 0
        parts = tails(_state(20_000), {}, set(), copy=False)
        async for _ in export_pieces(parts, Cuts(100, 1, 100), {}, set()):
            n += 1
            if n == 1:
                for child in set(_children()) - before:
                    os.kill(child, signal.SIGKILL)  # the exporting child, forked by this test
        return n

    with pytest.raises(ExportFailed, match="before its last chunk"):
        asyncio.run(run())
    assert set(_children()) == before  # reaped


def _exports_under_grpc(num: int, grpc_fork_support: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    if grpc_fork_support is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = grpc_fork_support
    out = subprocess.run([sys.executable, "-m", "tests.offloadd.export_under_grpc", str(num)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_fifty_exports_forked_while_grpc_serves_all_finish() -> None:
    """A process set up as the daemon is (offloadd imported before grpc) forks 50 exports back
    to back while its gRPC server answers calls: no child dies, every export is the state."""
    got = _exports_under_grpc(50, None)
    assert got["grpc_fork_support"] == "false"
    assert got["failed"] == [] and got["wrong"] == 0
    assert isinstance(got["calls"], int) and got["calls"] > 20  # traffic went on meanwhile


@pytest.mark.slow
def test_with_grpc_fork_handlers_on_export_children_die() -> None:
    """What offloadd/__init__ turns off: with gRPC core's fork handlers on, its threads start
    again in the child, and children die (status 11; 9 of 50 on the 2-core machine)."""
    got = _exports_under_grpc(100, "1")
    assert got["failed"], got


def test_a_serving_daemon_forks_fifty_exports_and_no_child_dies(tmp_path: Path, redis_url: str) -> None:
    """The real daemon, a checkpoint every 50 ms while an engine streams GPU-tier batches and a
    storer stores through gRPC: 50 forked exports written, not one fell back to the loop."""
    daemon = DaemonProcess(tmp_path / "d", redis_url, "forks", extra_args=(
        "--checkpoint-interval-s", "0.05", "--checkpoint-records", "1000000",
        "--checkpoint-fork-blocks", "0"))
    daemon.start()
    pub = SyntheticPublisher(daemon.target, "forks-gpu", pause_s=0.002, max_resident=2000).start()
    storer = SyntheticStorer(daemon.target, "forks-store", chain_len=4, pause_s=0.01).start()
    try:
        deadline = time.monotonic() + 90
        while daemon.log_path.read_text().count("checkpoint or trim failed") == 0 and _written(daemon) < 50:
            assert time.monotonic() < deadline, daemon.log_tail()
            time.sleep(0.2)
    finally:
        storer.stop()
        pub.stop()
        pub.close()
        assert daemon.stop() == 0, daemon.log_tail()
    text = daemon.log_path.read_text()
    assert "export child failed" not in text and "checkpoint or trim failed" not in text, daemon.log_tail()
    assert _written(daemon) >= 50 and storer.stats.stores > 0 and pub.stream.acked_seq > 0


def _written(daemon: DaemonProcess) -> int:
    """Checkpoints the daemon logged as written."""
    return len(re.findall(r'"msg": "checkpoint \S+ written', daemon.log_path.read_text()))
