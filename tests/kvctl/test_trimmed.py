"""kvctl on a Redis log the daemon trimmed behind its checkpoints (DESIGN.md 3.5): replay starts
from the newest checkpoint at or before the offset asked for, verify and stats from the oldest
usable one (the most history), and they say so; an offset before every
checkpoint and the retained log is refused, naming the oldest one that can be rebuilt."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from events.checkpoint import Manifest
from events.logkeys import LogKeys
from kvctl.main import main as kvctl
from offloadd.client import IngestStream
from tests.bridge.test_trimmed_log import CKPT_ARGS, daemon_state, publish, publish_until_trimmed
from tests.kvctl.test_daemon import _from_json
from tests.support.offloadd_proc import DaemonProcess


def test_kvctl_reads_a_trimmed_log_from_its_checkpoint(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    namespace = "trim" + uuid.uuid4().hex[:8]
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, extra_args=CKPT_ARGS)
    keys, admin = LogKeys(namespace), redis.Redis.from_url(redis_url)
    raw: Any
    proc.start()
    stream = IngestStream(proc.target, "gpu-engine", 3)
    try:
        publish(stream, 0, 300)
        first, _ = publish_until_trimmed(stream, admin, keys, 300, 100)
        now = daemon_state(proc)
        deadline = time.monotonic() + 10
        while True:  # the newest checkpoint at the head: no other comes while kvctl runs
            raw = admin.get(keys.checkpoint)
            offsets = []
            for ckpt_id in msgspec.msgpack.decode(raw, type=tuple[str, ...]):
                raw = admin.get(keys.checkpoint_manifest(ckpt_id))
                offsets.append(msgspec.msgpack.decode(raw, type=Manifest).offset)
            if offsets[0] == now.offset or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        src = [redis_url, "--namespace", namespace]

        assert kvctl(["verify", *src]) == 0  # from the oldest usable checkpoint: the most history
        out = capsys.readouterr().out
        assert out.startswith("verify: OK:") and f"from checkpoint at offset {min(offsets)}" in out

        assert kvctl(["replay", *src, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["from"] == f"from checkpoint at offset {offsets[0]}"
        view, fences = _from_json(doc)
        assert doc["offset"] == now.offset and view == now.view()
        assert fences == {s: now.fence(s) for s in now.sources()}

        assert kvctl(["replay", *src, "--at", str(min(offsets))]) == 0
        assert f"from checkpoint at offset {min(offsets)}" in capsys.readouterr().out

        assert kvctl(["stats", *src]) == 0
        assert f"from checkpoint at offset {min(offsets)}" in capsys.readouterr().out

        assert first > 2
        assert kvctl(["replay", *src, "--at", "1"]) == 2
        err = capsys.readouterr().err
        assert f"oldest checkpoint is at offset {min(offsets)}, the oldest offset it can rebuild" in err
        assert "kvctl record" in err
    finally:
        stream.close()
        proc.kill()
