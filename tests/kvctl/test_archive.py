"""``kvctl record --log ... -o DIR``: the log archived to rotating files with a header (epoch,
first offset, the state before a trimmed start), resumable without duplicates or holes; and
replay/diff/verify/stats/plot reading archive + live log as one timeline, a gap reported."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from events.checkpoint import (
    Manifest,
    checkpoint_id,
    decode_ids,
    encode_chunk,
    encode_ids,
    encode_manifest,
    split,
)
from events.codec_jsonl import decode_header
from events.logkeys import LogKeys
from events.schema import LogRecord
from events.state import CacheState
from kvctl.archive import Archive
from kvctl.main import main as kvctl
from offloadd.client import IngestStream
from tests.bridge.test_trimmed_log import CKPT_ARGS, daemon_state, publish, publish_until_trimmed
from tests.kvctl.test_daemon import _from_json
from tests.offloadd.test_checkpoint import first_offset
from tests.support.bridge_proc import REPO_ROOT, FleetSimulator, LogWriter
from tests.support.offloadd_proc import DaemonProcess

KEYS = LogKeys("default")


def state_of(records: list[LogRecord], at: int | None = None) -> CacheState:
    state = CacheState()
    for r in records:
        if at is None or r.offset <= at:
            state.apply(r)
    return state


def write_checkpoint(admin: Any, state: CacheState, epoch: str) -> None:
    """A checkpoint as the daemon writes it (events.checkpoint's format), made newest."""
    snap = state.export()
    ckpt = checkpoint_id(epoch, snap.offset)
    sums, size = [], 0
    for i, part in enumerate(split(snap, 8)):
        data, checksum = encode_chunk(part)
        admin.set(KEYS.checkpoint_chunk(ckpt, i), data)
        sums.append(checksum)
        size += len(data)
    admin.set(KEYS.checkpoint_manifest(ckpt), encode_manifest(
        Manifest(ckpt, snap.offset, epoch, time.time(), tuple(sums), size)))
    admin.set(KEYS.checkpoint, encode_ids((ckpt, *decode_ids(admin.get(KEYS.checkpoint)))))


def trim_to(admin: Any, first: int) -> None:
    admin.xtrim(KEYS.log, minid=f"{first}-0", approximate=False)


def headers(out: Path) -> list[tuple[str, int, int | None]]:
    """(file, first offset, base offset) of each archive file, in name order."""
    found = []
    for p in sorted(out.glob("*.jsonl")):
        h = decode_header(p.open("rb").readline())
        found.append((p.name, h.first_offset, None if h.base is None else h.base.offset))
    return found


def replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], Any]:
    assert kvctl(["replay", *args, "--json"]) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    return doc, _from_json(doc)


@pytest.fixture
def admin(redis_url: str) -> Any:
    client = redis.Redis.from_url(redis_url)
    client.set(KEYS.epoch, "epoch-one")
    yield client
    client.close()


def test_archive_rotates_and_resumes_without_duplicates_or_holes(
    redis_url: str, admin: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fleet, writer = FleetSimulator(["engine-a", "engine-b"], seed=5), LogWriter(admin)
    records = fleet.write(writer, 50)
    out = tmp_path / "archive"
    record = ["record", "--log", redis_url, "-o", str(out), "--rotate-records", "20"]
    assert kvctl(record) == 0
    assert "archived 50 records" in capsys.readouterr().err
    assert [(f, o) for f, o, _ in headers(out)] == [
        ("000000000001-epoch-on.jsonl", 1), ("000000000021-epoch-on.jsonl", 21),
        ("000000000041-epoch-on.jsonl", 41)]
    assert decode_header((out / "000000000041-epoch-on.jsonl").open("rb").readline()).epoch == "epoch-one"

    with (out / "000000000041-epoch-on.jsonl").open("ab") as fp:
        fp.write(b'{"offset":51,"source":"engine-a","inc')  # killed while writing a line
    records += fleet.write(writer, 30)
    assert kvctl([*record, "--progress"]) == 0
    err = capsys.readouterr().err
    assert "cut off 37 bytes of an unfinished line" in err and "archived 30 records" in err
    assert "\rarchiving: 30/30 records (100%)" in err
    archived = [json.loads(line)["offset"] for p in sorted(out.glob("*.jsonl"))
                for line in p.read_text().splitlines()[1:]]
    assert archived == list(range(1, 81))  # each offset once, in order

    doc, (view, fences) = replay_json(capsys, str(out))
    want = state_of(records)
    assert doc["offset"] == 80 and view == want.view()
    assert fences == {s: want.fence(s) for s in want.sources()}
    doc, (view, _) = replay_json(capsys, str(out), "--at", "33")
    assert view == state_of(records, 33).view()
    assert kvctl(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith("verify: OK: 80 records, last offset 80")


def test_records_trimmed_before_archived_are_a_reported_gap_bridged_by_the_checkpoint(
    redis_url: str, admin: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fleet, writer = FleetSimulator(["engine-a", "engine-b"], seed=7), LogWriter(admin)
    records = fleet.write(writer, 60)
    out = tmp_path / "archive"
    record = ["record", "--log", redis_url, "-o", str(out)]
    assert kvctl(record) == 0
    records += fleet.write(writer, 60)
    write_checkpoint(admin, state_of(records, 100), "epoch-one")
    trim_to(admin, 101)  # the archiver was down longer than the retention
    capsys.readouterr()
    assert kvctl(record) == 0
    err = capsys.readouterr().err
    assert "gap: offsets 61..100 were trimmed from the log before they were archived" in err
    assert "1 gaps" in err
    assert [(o, b) for _, o, b in headers(out)] == [(1, None), (101, 100)]

    doc, (view, _) = replay_json(capsys, str(out))
    assert doc["offset"] == 120 and view == state_of(records).view()
    assert doc["from"] == "from archived checkpoint at offset 100"
    _doc, (view, _) = replay_json(capsys, str(out), "--at", "50")
    assert view == state_of(records, 50).view()
    assert kvctl(["replay", str(out), "--at", "80"]) == 2
    assert ("offsets 61..100 are in neither the archive nor the live log and no checkpoint "
            "after them reaches it") in capsys.readouterr().err

    assert kvctl(["verify", str(out), "--json"]) == 1
    cap = capsys.readouterr()
    report = json.loads(cap.out)
    assert [(p["kind"], p["detail"]) for p in report["problems"]] == [("missing", "offsets 61..100")]
    assert report["records"] == 80 and report["last_offset"] == 120
    assert "offsets 61..100 are in neither the archive nor the live log" in cap.err

    assert kvctl(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["records"] == 80 and stats["missing"] == [[61, 100]]

    png = out.parent / "history.png"
    assert kvctl(["plot", str(out), "-o", str(png)]) == 0
    cap = capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "(80 records)" in cap.err
    assert "offsets 61..100 are in neither the archive nor the live log" in cap.err


def test_archive_and_live_log_read_as_one_timeline(
    redis_url: str, admin: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fleet, writer = FleetSimulator(["engine-a", "engine-b", "offloadd"], seed=9), LogWriter(admin)
    records = fleet.write(writer, 60)
    out = tmp_path / "archive"
    assert kvctl(["record", "--log", redis_url, "-o", str(out)]) == 0
    records += fleet.write(writer, 60)
    write_checkpoint(admin, state_of(records, 40), "epoch-one")
    trim_to(admin, 41)  # archive 1..60, live log 41..120: together the whole history
    both = [redis_url, "--archive", str(out)]
    capsys.readouterr()

    assert kvctl(["replay", redis_url, "--at", "20"]) == 2  # the live log alone cannot
    capsys.readouterr()
    doc, (view, _) = replay_json(capsys, *both, "--at", "20")
    assert view == state_of(records, 20).view() and "from" not in doc
    doc, (view, _) = replay_json(capsys, *both)
    assert doc["offset"] == 120 and view == state_of(records).view()
    assert kvctl(["diff", *both, "10", "110", "--json"]) == 0
    changes = json.loads(capsys.readouterr().out)["changes"]
    a, b = state_of(records, 10).view(), state_of(records, 110).view()
    assert {(c["source"], c["medium"], c["group_idx"]): (set(c["added"]), set(c["removed"]))
            for c in changes} == {k: (set(b.get(k, ())) - set(a.get(k, ())),
                                      set(a.get(k, ())) - set(b.get(k, ())))
                                  for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert kvctl(["verify", *both]) == 0
    assert capsys.readouterr().out.startswith("verify: OK: 120 records, last offset 120")
    assert kvctl(["stats", *both, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["records"] == 120 and "missing" not in stats and "from_checkpoint" not in stats

    records += fleet.write(writer, 40)
    write_checkpoint(admin, state_of(records, 150), "epoch-one")
    trim_to(admin, 151)  # now 61..150 are in neither: a gap the checkpoint at 150 bridges
    doc, (view, _) = replay_json(capsys, *both)
    assert doc["offset"] == 160 and view == state_of(records).view()
    assert kvctl(["stats", *both]) == 0
    cap = capsys.readouterr()
    assert "missing: offsets 61..150 (in neither the archive nor the live log)" in cap.out
    assert "records: 70 (last offset 160)" in cap.out
    assert "continuing from the checkpoint at offset 150" in cap.err


def test_a_new_log_epoch_starts_new_files_and_readers_pick_one_log(
    redis_url: str, admin: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    old = FleetSimulator(["engine-a"], seed=1).write(LogWriter(admin), 10)
    out = tmp_path / "archive"
    record = ["record", "--log", redis_url, "-o", str(out)]
    assert kvctl(record) == 0
    admin.flushdb()  # Redis lost the log; the daemon starts a new one
    admin.set(KEYS.epoch, "epoch-two")
    new = FleetSimulator(["engine-b"], seed=2).write(LogWriter(admin), 15)
    assert kvctl(record) == 0
    assert [(f, o) for f, o, _ in headers(out)] == [
        ("000000000001-epoch-on.jsonl", 1), ("000000000001-epoch-tw.jsonl", 1)]
    capsys.readouterr()
    assert kvctl(["replay", str(out), "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["offset"] == 15 and _from_json(doc)[0] == state_of(new).view() != state_of(old).view()
    assert "also holds other logs (epochs epoch-one); reading epoch epoch-two" in cap.err


def test_bad_archive_input_is_a_clear_error(
    redis_url: str, admin: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    FleetSimulator(["engine-a"], seed=1).write(LogWriter(admin), 5)
    assert kvctl(["replay", redis_url, "--archive", str(tmp_path / "nope")]) == 2
    assert "no archive directory" in capsys.readouterr().err
    assert kvctl(["record", "--log", redis_url, "-o", "-"]) == 2
    assert "names the archive directory" in capsys.readouterr().err
    assert kvctl(["record", "--follow", "-o", str(tmp_path / "x")]) == 2
    assert "give --log" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "000000000001-x.jsonl").write_text('{"offset": 1}\n')
    assert kvctl(["stats", str(bad)]) == 2
    assert "not an archive file (no header line)" in capsys.readouterr().err
    (bad / "000000000001-x.jsonl").write_text('{"kvoffload_archive":9,"namespace":"default",'
                                              '"epoch":null,"first_offset":1,"created_ts":0}\n')
    assert kvctl(["verify", str(bad)]) == 2
    assert "format version 9, this kvctl reads version 1" in capsys.readouterr().err


def test_follow_archives_a_live_daemons_log_and_survives_its_trims(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """A real daemon that checkpoints and trims often; ``record --follow`` archives every record
    while the log is trimmed behind it (fed at the archiver's pace: keeping up with any
    publisher on a loaded machine is not a property), stops on SIGTERM, and resumed after the log moved past it reports the gap and continues
    from the daemon's checkpoint; archive + live log rebuild the daemon's state."""
    namespace = "arch" + uuid.uuid4().hex[:8]
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, extra_args=CKPT_ARGS)
    keys, admin = LogKeys(namespace), redis.Redis.from_url(redis_url)
    out = tmp_path / "archive"
    record = [sys.executable, "-m", "kvctl", "record", "--log", redis_url, "--namespace",
              namespace, "-o", str(out), "--rotate-records", "100"]
    proc.start()
    stream = IngestStream(proc.target, "gpu-engine", 3)
    follower = subprocess.Popen([*record, "--follow"], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)

    def archived_up_to_head() -> int:
        """Wait until the follower has archived the whole log (however slow a loaded machine
        makes it); the head."""
        head = int(admin.get(keys.head) or 0)
        deadline = time.monotonic() + 60
        while not out.is_dir() or Archive.open(out).last_offset(admin.get(keys.epoch).decode()) < head:
            assert time.monotonic() < deadline and follower.poll() is None, follower.poll()
            time.sleep(0.05)
        return head

    try:
        # Ten records at a time, each ten once the follower holds everything before: the daemon
        # keeps the newest 20 records (CKPT_ARGS), so whatever it trims was archived already,
        # and any gap would be the archiver's. It trims behind the follower all along.
        at = 0
        while at < 300 or not (first_offset(admin, keys) > 100 and admin.get(keys.checkpoint)):
            assert at < 3000, f"the log was not trimmed past 100 (first offset {first_offset(admin, keys)})"
            publish(stream, at, 10)
            at += 10
            head = archived_up_to_head()
        first = first_offset(admin, keys)
        follower.send_signal(signal.SIGTERM)
        _, err = follower.communicate(timeout=10)
        assert follower.returncode == 0, err
        assert f"archived {head} records" in err and "gap" not in err, err

        publish_until_trimmed(stream, admin, keys, at, head + 1)  # archiver down too long
        assert kvctl(record[3:]) == 0
        err = capsys.readouterr().err
        assert f"gap: offsets {head + 1}.." in err and "archiving from the checkpoint at offset" in err
        now = daemon_state(proc)
        both = [redis_url, "--namespace", namespace, "--archive", str(out)]
        assert kvctl(["replay", *both, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["offset"] == now.offset and _from_json(doc)[0] == now.view()
        assert kvctl(["verify", *both, "--json"]) == 1  # only the gap
        report = json.loads(capsys.readouterr().out)
        assert [p["kind"] for p in report["problems"]] == ["missing"]
        assert report["problems"][0]["offset"] == head + 1 and report["last_offset"] == now.offset
        assert first > 1 and report["records"] > now.offset - head  # archived history included
    finally:
        if follower.poll() is None:
            follower.kill()
        stream.close()
        proc.kill()
        admin.close()


def test_a_log_trimmed_while_it_is_read_is_an_error_not_a_skip(
    redis_url: str, admin: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    """The horizon moving under a reader: the live log is trimmed between two of the reader's
    range reads (1000 records each), so the records it was about to read are gone."""
    import argparse

    from kvctl.errors import KvctlError
    from kvctl.logsource import open_log

    FleetSimulator(["engine-a"], seed=4).write(LogWriter(admin), 2500)
    args = argparse.Namespace(log=redis_url, namespace="default", archive=None, progress=False)
    view = open_log(args)
    state = view.state()
    with pytest.raises(KvctlError, match=re.escape(
            "offset 1001 is gone from the live log (read 2001 next): it was trimmed while being "
            "read; run the command again")):
        for record in view.records:
            state.apply(record)
            if record.offset == 500:
                trim_to(admin, 2001)  # the daemon trims while the reader is at offset 500
    assert state.offset == 1000 and not state.violations  # nothing applied past what was read
