"""The process: health, reflection, unix socket, /metrics, Subscribe follow, CLI errors."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from events.schema import BlockStored, LogRecord
from offloadd.client import GroupQuery, IngestStream, OffloadClient
from tests.offloadd.conftest import GROUP, SLOT, chain
from tests.support.offloadd_proc import REPO, DaemonProcess
from tests.support.redis_proc import free_port


def test_health_reflection_and_unix_socket(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvcache.v1.OffloadStore", "kvcache.v1.EventIngest", "kvcache.v1.EventLog"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        (reply,) = list(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"kvcache.v1.OffloadStore", "kvcache.v1.EventIngest", "kvcache.v1.EventLog",
                "grpc.health.v1.Health"} <= names
    with OffloadClient(f"unix:{daemon.unix_socket}") as c:
        reg = c.register_engine("e", 1, "m", [GROUP])
        assert reg.groups[0].slot_bytes == SLOT


def test_metrics_endpoint(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=8 * SLOT, metrics=True)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            c.register_engine("e", 1, "m", [GROUP])
            res = c.reserve("e", 0, chain(3))
            c.commit("e", res.reservation_id)
            c.lookup("e", [GroupQuery(0, tuple(b.block_hash for b in chain(4)))])
        s = IngestStream(proc.target, "g", 1)
        s.submit([BlockStored((1,), None, (1, 2, 3, 4), 4, "GPU")])
        assert s.flush(5)
        s.close()
        url = f"http://127.0.0.1:{proc.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        for line in (
            'offloadd_blocks{layout="1",state="ready",tier="CPU"} 3.0',
            'offloadd_blocks{layout="",state="ready",tier="GPU"} 1.0',
            f'offloadd_bytes{{tier="CPU"}} {3.0 * SLOT}',
            "offloadd_lookup_hits_total 3.0",
            "offloadd_lookup_misses_total 1.0",
            "offloadd_evictions_total 0.0",
            'offloadd_ingest_batches_total{status="applied"} 1.0',
            "offloadd_log_offset 2.0",
            'offloadd_rpc_seconds_count{code="OK",method="Commit"} 1.0',
            "offloadd_ingest_lag_seconds_count 1.0",
        ):
            assert line in text, line
    finally:
        proc.kill()


def test_subscribe_follow_wakes_on_append(daemon: DaemonProcess, client: OffloadClient) -> None:
    got: list[LogRecord] = []

    def follow() -> None:
        with OffloadClient(daemon.target) as c:
            for record in c.subscribe(1, follow=True, timeout_s=10):
                got.append(record)
                if len(got) == 2:
                    return

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.3)
    client.register_engine("e", 1, "m", [GROUP])
    for blocks in (chain(1, salt="a"), chain(1, salt="b")):
        res = client.reserve("e", 0, blocks)
        client.commit("e", res.reservation_id)
    t.join(timeout=5)
    assert [r.offset for r in got] == [1, 2]


def _run_cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "offloadd", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_errors_without_traceback(tmp_path: Path) -> None:
    bad = _run_cli("--capacity-bytes", "-5")
    assert bad.returncode == 2
    assert "capacity_bytes: must be > 0" in bad.stderr and "Traceback" not in bad.stderr
    bad = _run_cli("--eviction", "fifo")
    assert bad.returncode == 2 and "eviction: must be one of" in bad.stderr
    bad = _run_cli("--grpc-port", "abc")
    assert bad.returncode == 2 and "grpc_port" in bad.stderr and "Traceback" not in bad.stderr
    dead = _run_cli("--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--grpc-port", "0",
                    "--metrics-port", "-1", "--arena-dir", str(tmp_path), "--redis-timeout-s", "0.5")
    assert dead.returncode == 1
    assert "cannot start" in dead.stderr and "Redis unreachable" in dead.stderr
    assert "Traceback" not in dead.stderr


def test_client_round_trip(daemon: DaemonProcess) -> None:
    """Every OffloadStore and EventLog call of the one client, end to end."""
    with OffloadClient(daemon.target) as c:
        reg = c.register_engine("a", 1, "m", [GROUP])
        arena = reg.map_arena(0)
        res = c.reserve("a", 0, chain(2))
        for _, slot in res.blocks:
            arena.write(slot, bytes([slot]) * SLOT)
        committed = c.commit("a", res.reservation_id)
        found = c.lookup("a", [GroupQuery(0, tuple(b.block_hash for b in chain(2)))], pin=True)
        assert found.results[0].generations == res.generations and min(res.generations) > 0
        released = c.release("a", found.lease_id)
        data = c.read_blocks("a", 0, [chain(2)[1].block_hash])
        records = list(c.subscribe(1))
        assert data[0].data == bytes([found.results[0].slots[1]]) * SLOT
        assert c.snapshot().offset == records[-1].offset == committed.log_offset
    assert (committed.num_committed, found.results[0].num_prefix, released) == (2, 2, 2)


def test_client_retries_network_errors_only(tmp_path: Path, redis_url: str, namespace: str) -> None:
    from offloadd.client import OffloadClientError, OffloadUnavailable, RetryPolicy

    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, metrics=True)
    proc.start()
    try:
        with OffloadClient(proc.target, retry=RetryPolicy(attempts=40, max_backoff_s=0.5)) as c:  # ~19 s
            c.register_engine("e", 1, "m", [GROUP])
            proc.kill()
            restarter = threading.Thread(target=proc.restart)
            restarter.start()
            assert c.stats().num_engines == 1  # retried through the restart
            restarter.join()
            with pytest.raises(OffloadClientError) as refused:
                c.release("e", "no-such-lease")
            assert refused.value.code.name == "FAILED_PRECONDITION"
            # An aborted call's status reaches the client before the server's interceptor counts
            # it: read the metrics until the count shows (a loaded CI run read them in between).
            url = f"http://127.0.0.1:{proc.metrics_port}/metrics"
            want = 'offloadd_rpc_seconds_count{code="FAILED_PRECONDITION",method="Release"} 1.0'
            deadline = time.monotonic() + 10
            while want not in (text := urllib.request.urlopen(url, timeout=5).read().decode()):
                assert time.monotonic() < deadline, text
                time.sleep(0.05)
        proc.kill()
        with OffloadClient(proc.target, retry=RetryPolicy(attempts=2)) as c:
            t0 = time.monotonic()
            try:
                c.stats()
                raise AssertionError("expected UNAVAILABLE")
            except OffloadUnavailable as exc:
                assert exc.code.name == "UNAVAILABLE"
            assert time.monotonic() - t0 < 3
    finally:
        proc.kill()
