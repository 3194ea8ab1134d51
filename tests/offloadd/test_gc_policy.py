"""The daemon keeps its state out of the garbage collector's view (events.state_gc.GcPolicy,
run four times a second by offloadd.edge.server) and runs a full collection every
``full_gc_interval_s``; the interval must be positive."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from offloadd.config import ConfigError, load_config
from tests.support.offloadd_proc import DaemonProcess


def test_full_collections_run_at_the_configured_interval(tmp_path: Path, redis_url: str, namespace: str) -> None:
    daemon = DaemonProcess(tmp_path / "d", redis_url, namespace,
                           extra_args=("--full-gc-interval-s", "0.5", "--log-level", "INFO"))
    daemon.start()
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and daemon.log_path.read_text().count("full garbage collection took") < 2:
            time.sleep(0.2)
        assert daemon.log_path.read_text().count("full garbage collection took") >= 2, daemon.log_tail()
    finally:
        daemon.kill()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_full_gc_interval_must_be_positive(value: str) -> None:
    with pytest.raises(ConfigError, match="full_gc_interval_s"):
        load_config([], {"KVD_FULL_GC_INTERVAL_S": value})
