"""Foreign data in Redis: a write is all-or-nothing, start-up names what is wrong in one line
with the repair command, kvctl verify finds it and kvctl repair removes it."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from events.logkeys import LogKeys
from events.schema import BlockStored, LogRecord
from events.state import CacheState
from kvctl.main import main as kvctl
from offloadd.client import OffloadClient, OffloadClientError
from offloadd.log.metadata import Append, ForeignEntry, MetadataStore
from tests.offloadd.conftest import GROUP, SLOT, chain
from tests.support.offloadd_proc import REPO, DaemonProcess


def _start_fails(proc: DaemonProcess) -> str:
    """Run the daemon to its exit: code 1 and one plain line on stderr besides its structured
    (JSON) log lines, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(proc.args, capture_output=True, text=True, timeout=30, env=env, cwd=REPO)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = [ln for ln in done.stderr.strip().splitlines() if not ln.startswith("{")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_hand_appended_entry_is_refused_diagnosed_and_repaired(
    tmp_path: Path, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = LogKeys(namespace)
    admin = redis.Redis.from_url(redis_url)
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=16 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            c.register_engine("e", 1, "m", [GROUP])
            c.commit("e", c.reserve("e", 0, chain(1)).reservation_id)
            head = int(admin.get(keys.head) or 0)
            foreign = f"{head + 1}-0"
            admin.xadd(keys.log, {"x": "1"}, id=foreign)
            with pytest.raises(OffloadClientError) as err:
                c.commit("e", c.reserve("e", 0, chain(1, start=1)).reservation_id)
            assert "did not write" in err.value.message
        assert proc.proc is not None and proc.proc.wait(timeout=10) == 3
        proc.proc = None
        assert int(admin.get(keys.head) or 0) == head  # nothing half-applied
        assert admin.xlen(keys.log) == head + 1

        line = _start_fails(proc)
        url = redis_url.rstrip("/")
        assert line.startswith(f"offloadd: log entry {foreign} of {keys.log} is not a record "
                               f"(field b'x'); inspect with 'kvctl verify "), line
        assert f"--namespace {namespace}', remove foreign data with 'kvctl repair " in line
        assert line.endswith(f"--namespace {namespace} --drop-foreign'")
        capsys.readouterr()

        assert kvctl(["verify", url, "--namespace", namespace]) == 1
        out = capsys.readouterr().out
        assert f"log entry {foreign}: no field b'r'" in out
        assert kvctl(["repair", url, "--namespace", namespace, "--drop-foreign"]) == 0
        out = capsys.readouterr().out
        assert f"repair: removed log entry {foreign}" in out
        assert kvctl(["verify", url, "--namespace", namespace]) == 0
        capsys.readouterr()

        proc.restart()
        with OffloadClient(proc.target) as c:
            c.register_engine("e", 1, "m", [GROUP])
            c.commit("e", c.reserve("e", 0, chain(1, start=1)).reservation_id)
        assert int(admin.get(keys.head) or 0) > head
    finally:
        admin.close()
        proc.kill()


def test_auto_id_entry_refuses_the_write_until_repaired(redis_url: str) -> None:
    """XADD '*' leaves an ID far past every offset; after XDEL the stream still remembers it,
    so repair also puts the stream's last ID back (XSETID)."""
    keys = LogKeys("autoid")

    def item(seq: int) -> Append:
        return Append("e", 1, seq, (BlockStored((seq,), None, (1, 2, 3, 4), 4, "GPU"),),
                      lambda pipe: None, lambda record: None)

    async def scenario() -> list[object]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        out: list[object] = [await md.append(item(1))]
        await client.xadd(keys.log, {"r": b"junk"})
        for _ in range(2):
            try:
                out.append(await md.append(item(2)))
            except ForeignEntry as exc:
                out.append(exc)
            if _ == 0:
                assert await client.get(keys.head) == b"1"
                assert kvctl(["repair", redis_url, "--namespace", keys.namespace, "--drop-foreign"]) == 0
        await client.aclose()
        return out

    first, refused, written = asyncio.run(scenario())
    assert isinstance(first, LogRecord) and first.offset == 1
    assert isinstance(refused, ForeignEntry) and "kvctl repair" in str(refused)
    assert isinstance(written, LogRecord) and written.offset == 2


def test_garbage_in_projection_keys_stops_startup_in_one_line(
    tmp_path: Path, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = LogKeys(namespace)
    admin = redis.Redis.from_url(redis_url)
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=16 * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            c.register_engine("e", 1, "m", [GROUP])
        assert proc.stop() == 0
        admin.hset(keys.layouts, "junk", b"garbage")
        line = _start_fails(proc)
        assert line.startswith(f"offloadd: field b'junk' of {keys.layouts} does not decode ("), line
        assert "--drop-foreign'" in line

        admin.hdel(keys.layouts, "junk")
        admin.delete(keys.engines)
        admin.sadd(keys.engines, "x")
        line = _start_fails(proc)
        assert line.startswith(f"offloadd: WRONGTYPE: key {keys.engines} is a set, expected a hash;")

        admin.hset(keys.layouts, "junk", b"garbage")
        url = redis_url.rstrip("/")
        assert kvctl(["repair", url, "--namespace", namespace, "--drop-foreign"]) == 0
        out = capsys.readouterr().out
        assert f"repair: deleted {keys.engines}: a set, not a hash" in out
        assert f"repair: removed field b'junk' of {keys.layouts}" in out
        proc.restart()
    finally:
        admin.close()
        proc.kill()


def test_repair_refuses_while_a_daemon_owns_the_namespace(
    tmp_path: Path, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace)
    proc.start()
    try:
        assert kvctl(["repair", redis_url, "--namespace", namespace, "--drop-foreign"]) == 2
        assert "a daemon owns namespace" in capsys.readouterr().err
        assert kvctl(["repair", redis_url, "--namespace", namespace, "--drop-foreign", "--force"]) == 0
    finally:
        proc.kill()
