"""The check of restored blocks that runs right after SERVING (offloadd.edge.server,
Integrity.verify_restored) goes through every restored block in steps of VERIFY_BATCH, takes
out a corrupt one and reports both counts."""

from __future__ import annotations

import json
import time
from pathlib import Path

from offloadd.client import GroupQuery, OffloadClient
from offloadd.edge.server import VERIFY_BATCH
from tests.offloadd.conftest import SLOT
from tests.offloadd.test_restart import fill, flip_byte
from tests.support.offloadd_proc import DaemonProcess


def _verified_line(proc: DaemonProcess, timeout_s: float = 20.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and json.loads(line).get("msg") == "restored blocks verified":
                return dict(json.loads(line))
        time.sleep(0.05)
    raise AssertionError(f"no 'restored blocks verified' line:\n{proc.log_tail()}")


def test_every_restored_block_is_checked_in_steps(tmp_path: Path, redis_url: str, namespace: str) -> None:
    n = 3 * VERIFY_BATCH + 7
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace, capacity_bytes=(n + 8) * SLOT)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            hashes = fill(c, n)
            proc.kill()
            flip_byte(proc, namespace, 5 * SLOT)  # one block in the first step
            proc.restart()
            line = _verified_line(proc)
            assert (line["num_verified"], line["num_failed"]) == (n - 1, 1)
            assert c.stats().num_blocks == n - 1
            found = c.lookup("e", [GroupQuery(0, tuple(hashes))]).results[0]
            assert found.num_prefix == 5  # the chain stops at the block that failed
    finally:
        proc.kill()
