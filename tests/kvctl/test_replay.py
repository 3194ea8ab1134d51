"""kvctl replay and diff, from Redis and from a file, against the reducer's own state."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis

from events.codec_jsonl import dump_records
from events.schema import LogRecord
from events.state import CacheState
from kvctl.main import main as kvctl
from tests.support.bridge_proc import REPO_ROOT, FleetSimulator, LogWriter


@pytest.fixture
def log(redis_url: str) -> Iterator[list[LogRecord]]:
    client = redis.Redis.from_url(redis_url)
    records = FleetSimulator(["engine-a", "engine-b", "offloadd"], seed=11).write(LogWriter(client), 120)
    yield records
    client.close()


@pytest.fixture
def log_file(log: list[LogRecord], tmp_path: Path) -> Path:
    path = tmp_path / "log.jsonl"
    with path.open("w") as fp:
        dump_records(log, fp)
    return path


def _expected(records: list[LogRecord], at: int, only: str | None = None) -> dict[str, object]:
    state = CacheState()
    for r in records:
        if r.offset <= at:
            state.apply(r)
    sources = {}
    for source in state.sources():
        if only is not None and source != only:
            continue
        tiers = [
            {"medium": m, "group_idx": g, "blocks": sorted(state.blocks(s, m, g))}
            for (s, m, g) in sorted(state.counts()) if s == source
        ]
        fence = state.fence(source)
        sources[source] = {"fence": list(fence) if fence else None, "tiers": tiers}
    return {"offset": at, "ts": records[at - 1].ts, "sources": sources}


@pytest.mark.parametrize("where", ["redis", "file"])
def test_replay_at_offset_equals_the_reducer_state(
    where: str, redis_url: str, log: list[LogRecord], log_file: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = redis_url if where == "redis" else str(log_file)
    for at in (1, 57, 120):
        assert kvctl(["replay", target, "--at", str(at), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == _expected(log, at)


def test_replay_table_until_time_and_source(
    redis_url: str, log: list[LogRecord], capsys: pytest.CaptureFixture[str]
) -> None:
    cut = log[39].ts
    assert kvctl(["replay", redis_url, "--until", repr(cut), "--source", "engine-b"]) == 0
    out = capsys.readouterr().out.splitlines()
    expected = _expected(log, 40, "engine-b")
    assert out[0].startswith("state at offset 40 (")
    assert out[1].split() == ["SOURCE", "MEDIUM", "GROUP", "BLOCKS"]
    rows = [line.split() for line in out[2:]]
    want = [
        ["engine-b", t["medium"], "0", str(len(t["blocks"]))]
        for t in expected["sources"]["engine-b"]["tiers"]  # type: ignore[index]
    ]
    assert rows == want


def test_diff_between_offsets(
    log_file: Path, log: list[LogRecord], capsys: pytest.CaptureFixture[str]
) -> None:
    assert kvctl(["diff", str(log_file), "30", "90", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    a, b = CacheState(), CacheState()
    for r in log[:30]:
        a.apply(r)
    for r in log[:90]:
        b.apply(r)
    va, vb = a.view(), b.view()
    want = []
    for key in sorted(va.keys() | vb.keys()):
        old, new = va.get(key, frozenset()), vb.get(key, frozenset())
        if old != new:
            want.append({"source": key[0], "medium": key[1], "group_idx": key[2],
                         "added": sorted(new - old), "removed": sorted(old - new)})
    assert got == {"from": 30, "to": 90, "changes": want}
    assert want, "the fixture log should change something between 30 and 90"
    assert kvctl(["diff", str(log_file), "5", "5"]) == 0
    assert capsys.readouterr().out == "diff 5 -> 5\n(no change)\n"


def test_user_errors_are_one_line_without_traceback(
    redis_url: str, log_file: Path, log: list[LogRecord], capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["replay", str(log_file), "--at", "500"],
         "kvctl: error: offset 500 is beyond the end of the log (last offset 120)"),
        (["replay", str(log_file), "--source", "nobody"],
         "kvctl: error: no source 'nobody' at offset 120 (known: engine-a, engine-b, offloadd)"),
        (["replay", "/no/such.jsonl"], "kvctl: error: no such file: /no/such.jsonl"),
        (["replay", redis_url, "--namespace", "a:b"], "kvctl: error: namespace must be non-empty"),
        (["replay", str(log_file), "--until", "yesterday"],
         "kvctl: error: --until: 'yesterday' is neither epoch seconds nor ISO 8601"),
        (["diff", str(log_file), "9", "3"], "kvctl: error: A (9) must not be after B (3)"),
        (["replay", "redis://127.0.0.1:1/0"], "kvctl: error: cannot read the log at redis://127.0.0.1:1/0"),
    ]
    for argv, message in cases:
        assert kvctl(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(message), (argv, err)
        assert err.count("\n") == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["plot", "--bin-s", "nan"], "argument --bin-s: must be > 0 seconds and finite, got 'nan'"),
    (["plot", "--bin-s", "0"], "argument --bin-s: must be > 0 seconds and finite, got '0'"),
    (["record", "--duration", "inf"], "argument --duration: must be > 0 seconds and finite, got 'inf'"),
    (["tail", "--timeout-s", "soon"], "argument --timeout-s: not a number of seconds: 'soon'"),
])
def test_a_bad_duration_is_a_usage_error(
    argv: list[str], message: str, log_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """nan passed plot's "<= 0" check and died in int(nan) with a traceback; inf never ends."""
    with pytest.raises(SystemExit) as done:
        kvctl([*argv, str(log_file), "--out", str(tmp_path / "out")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {message}\n") and "Traceback" not in err, err


def test_corrupt_file_names_the_line(tmp_path: Path, log_file: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = log_file.read_text().splitlines()
    lines[2] = lines[2].replace('"GPU"', '"TPU"').replace('"CPU"', '"TPU"')
    bad.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvctl", "replay", str(bad)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvctl: error: line 3: ")
    assert "Traceback" not in proc.stderr


def test_until_accepts_iso_8601(
    log: list[LogRecord], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import msgspec

    base = 1_796_000_000.0  # 2026-11-29T...Z; one record per second from here
    timed = [msgspec.structs.replace(r, ts=base + i) for i, r in enumerate(log)]
    path = tmp_path / "timed.jsonl"
    with path.open("w") as fp:
        dump_records(timed, fp)
    iso = datetime.fromtimestamp(base + 29.5, UTC).isoformat().replace("+00:00", "Z")
    assert kvctl(["replay", str(path), "--until", iso, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = _expected(timed, 30)
    assert got == want
