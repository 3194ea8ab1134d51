"""kvctl verify and stats on healthy and broken logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from events.codec_jsonl import dump_records
from events.logkeys import LogKeys
from events.schema import BlockRemoved, BlockStored, LogRecord
from kvctl.main import main as kvctl
from tests.support.bridge_proc import FleetSimulator, LogWriter


def _stored(hashes: tuple[int, ...], parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(hashes, parent, tuple(range(2 * len(hashes))), 2, medium)  # type: ignore[arg-type]


def test_verify_ok_on_a_healthy_log(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    client = redis.Redis.from_url(redis_url)
    FleetSimulator(["engine-a", "offloadd"], seed=12).write(LogWriter(client), 80)
    client.close()
    assert kvctl(["verify", redis_url]) == 0
    assert capsys.readouterr().out == "verify: OK: 80 records, last offset 80, 2 sources\n"


def test_verify_reports_each_broken_invariant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [
        LogRecord(1, "e1", 1, 1, 1.0, (_stored((10, 11)),)),
        LogRecord(2, "e1", 1, 2, 2.0, (BlockRemoved((99,), "GPU"),)),  # never stored
        LogRecord(3, "e1", 1, 4, 3.0, (_stored((12,), 11),)),  # seq 3 lost
        LogRecord(5, "e1", 1, 5, 4.0, (_stored((20,), 77),)),  # offset 4 missing; orphan
    ]
    path = tmp_path / "broken.jsonl"
    with path.open("w") as fp:
        dump_records(records, fp)
    assert kvctl(["verify", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "verify: FAILED: 4 problems in 4 records, last offset 5, 1 sources"
    assert "log_gap (log offsets are not contiguous): 1" in out
    assert "  offset 5 source e1: expected offset 4" in out
    assert "unknown_block_removed (BlockRemoved of a block that was not resident): 1" in out
    assert "source_gap (a source's batch seq skipped (lost batches)): 1" in out
    assert "orphan_child (GPU BlockStored whose parent block is not resident): 1" in out
    assert kvctl(["verify", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert sorted(p["kind"] for p in report["problems"]) == [
        "log_gap", "orphan_child", "source_gap", "unknown_block_removed",
    ]


def test_stats_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [
        LogRecord(1, "e1", 1, 1, 100.0, (_stored((10, 11)), _stored((30,), None, "CPU"))),
        LogRecord(2, "e2", 1, 1, 101.0, (_stored((40, 41, 42)),)),
        LogRecord(3, "e1", 1, 2, 104.0, (BlockRemoved((11,), "GPU"),)),
    ]
    path = tmp_path / "log.jsonl"
    with path.open("w") as fp:
        dump_records(records, fp)
    assert kvctl(["stats", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats == {
        "records": 3, "last_offset": 3, "first_ts": 100.0, "last_ts": 104.0, "span_s": 4.0,
        "records_per_s": 0.75,
        "events": {"BlockRemoved": 1, "BlockStored": 3},
        "block_events": {"BlockRemoved GPU": 1, "BlockStored CPU": 1, "BlockStored GPU": 5},
        "records_per_source": {"e1": 2, "e2": 1},
        "resident_blocks": {"e1 CPU g0": 1, "e1 GPU g0": 1, "e2 GPU g0": 3},
        "violations": 0,
    }
    assert kvctl(["stats", str(path)]) == 0
    text = capsys.readouterr().out
    assert "records: 3 (last offset 3)" in text
    assert "  e2 GPU g0: 3" in text


def test_progress_line_on_request(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    client = redis.Redis.from_url(redis_url)
    FleetSimulator(["engine-a"], seed=17).write(LogWriter(client), 30)
    client.close()
    assert kvctl(["stats", redis_url, "--progress"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("\rstats: 30/30 records (100%) ") and err.endswith("\n")
    assert kvctl(["stats", redis_url]) == 0  # not a terminal: no progress line
    assert capsys.readouterr().err == ""


def test_verify_names_entries_that_are_not_records(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Entries past the head key and with foreign IDs are read too: each is a violation by ID;
    a head key that does not name the last record is one more."""
    client = redis.Redis.from_url(redis_url)
    FleetSimulator(["engine-a"], seed=3).write(LogWriter(client), 5)
    client.xadd(LogKeys().log, {"x": "1"}, id="6-0")
    client.xadd(LogKeys().log, {"r": b"\xc1"}, id="7-1")
    assert kvctl(["verify", redis_url]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "verify: FAILED: 2 problems in 5 records, last offset 5, 1 sources"
    assert "  offset 6 source ?: log entry 6-0: no field b'r' (fields [b'x'])" in out
    assert "  offset 7 source ?: log entry 7-1: not a record's entry ID (want OFFSET-0)" in out
    client.set(LogKeys().head, 9)
    client.close()
    assert kvctl(["verify", redis_url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(p["kind"] for p in report["problems"]) == ["head_mismatch", "undecodable", "undecodable"]
