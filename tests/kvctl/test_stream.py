"""kvctl record, tail and plot against a real kv-bridge process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from events.codec_jsonl import load_records
from kvctl.main import main as kvctl
from tests.support.bridge_proc import REPO_ROOT, BridgeProcess, FleetSimulator, LogWriter


def _kvctl_proc(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvctl", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
    )


def test_record_then_replay_equals_replaying_the_log(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis.Redis.from_url(redis_url)
    writer, sim = LogWriter(client), FleetSimulator(["engine-a", "engine-b"], seed=13)
    records = sim.write(writer, 30)  # before the recorder starts: fetched by --from-seq 0
    bridge = BridgeProcess(redis_url, tmp_path / "bridge")
    bridge.start()
    out = tmp_path / "rec.jsonl"
    try:
        rec = _kvctl_proc("record", "--pub", bridge.pub, "--replay", bridge.replay,
                          "--from-seq", "0", "--count", "50", "--out", str(out))
        time.sleep(1.0)  # the recorder subscribes; what it misses it replays
        for _ in range(20):
            records += sim.write(writer, 1)
            time.sleep(0.01)
        _, err = rec.communicate(timeout=30)
        assert rec.returncode == 0, err
        assert err == f"kvctl: recorded 50 batches to {out}\n"
    finally:
        bridge.stop()
        client.close()
    with out.open() as fp:
        got = list(load_records(fp))
    assert [r.offset for r in got] == list(range(1, 51))
    assert [(r.source, r.events) for r in got] == [(r.source, r.events) for r in records]
    tiers = {}
    for target in (redis_url, str(out)):
        assert kvctl(["replay", target, "--at", "50", "--json"]) == 0
        state = json.loads(capsys.readouterr().out)
        tiers[target] = {s: v["tiers"] for s, v in state["sources"].items()}
    assert tiers[str(out)] == tiers[redis_url]  # fences differ: a recording is unfenced


def test_tail_prints_one_line_per_event(redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    writer, sim = LogWriter(client), FleetSimulator(["engine-a"], seed=14)
    records = sim.write(writer, 3)
    bridge = BridgeProcess(redis_url, tmp_path / "bridge")
    bridge.start()
    try:
        tail = _kvctl_proc("tail", "--pub", bridge.pub, "--replay", bridge.replay,
                           "--from-seq", "0", "--count", "3")
        out, err = tail.communicate(timeout=30)
    finally:
        bridge.stop()
        client.close()
    assert tail.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 3
    for seq, (line, record) in enumerate(zip(lines, records, strict=True)):
        event = record.events[0]
        kind = type(event).__name__
        assert line.startswith(f"seq {seq}  "), line
        assert f"  engine-a  {kind} {event.medium} g0 {len(event.block_hashes)} blocks [" in line


def test_record_without_a_bridge_fails_cleanly(tmp_path: Path) -> None:
    proc = _kvctl_proc("record", "--pub", "tcp://127.0.0.1:1", "--replay", "tcp://127.0.0.1:1",
                       "--from-seq", "0", "--timeout-s", "1", "--out", str(tmp_path / "x.jsonl"))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.startswith("kvctl: error: no complete reply from tcp://127.0.0.1:1 in time")
    assert "Traceback" not in err


def test_plot_writes_a_png(redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client = redis.Redis.from_url(redis_url)
    FleetSimulator(["engine-a", "offloadd"], seed=15).write(LogWriter(client), 40)
    client.close()
    png = tmp_path / "state.png"
    assert kvctl(["plot", redis_url, "--out", str(png), "--bin-s", "0.5"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err == f"kvctl: wrote {png} (40 records)\n"
    assert kvctl(["plot", redis_url, "--namespace", "empty", "--out", str(png)]) == 2
    assert capsys.readouterr().err == "kvctl: error: the log is empty: nothing to plot\n"


def test_tail_follows_the_log_in_redis(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    writer, sim = LogWriter(client), FleetSimulator(["engine-b"], seed=19)
    records = sim.write(writer, 5)
    client.close()
    tail = _kvctl_proc("tail", "--log", redis_url, "--from-offset", "3", "--count", "2")
    out, err = tail.communicate(timeout=30)
    assert tail.returncode == 0, err
    lines = out.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["offset 3", "offset 4"]
    for line, record in zip(lines, records[2:4], strict=True):
        assert f"  engine-b  {type(record.events[0]).__name__} " in line
