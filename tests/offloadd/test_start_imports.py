"""What the daemon imports before it serves: numpy and the fleet's fill stay out of a lone
daemon's start (together ~0.2 s of CPU before SERVING; bench/bench_recovery.py measures it)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.child_process import REPO

_PROBE = (
    "import sys, offloadd.__main__, offloadd.edge.server; "
    "print(sorted(m for m in ('numpy', 'offloadd.fleet.fill', 'offloadd.fleet.links') "
    "if m in sys.modules))"
)


def test_a_lone_daemon_imports_no_numpy_and_no_fleet_fill() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_block_hashing_still_imports_numpy_when_used() -> None:
    # a prompt long enough for the numpy fast path (events.hashing._FAST_MIN_BLOCKS blocks or more)
    probe = ("import sys; from events.hashing import BlockHasher, _FAST_MIN_BLOCKS; "
             "h = BlockHasher(seed='s'); blocks = _FAST_MIN_BLOCKS + 4; "
             "n = len(h.hash_blocks(list(range(16 * blocks)), bytes(32))); "
             "print('numpy' in sys.modules, n == blocks)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.split() == ["True", "True"]


def test_the_daemons_imports_leave_the_collector_as_they_found_it() -> None:
    """offloadd.__main__ loads its imports with the collector off (a restart's time) and turns
    it back on only if it was on: importing it changes nothing for the importer."""
    probe = ("import gc, sys; on = sys.argv[1] == 'on'; gc.enable() if on else gc.disable(); "
             "import offloadd.__main__; print(gc.isenabled())")
    for state, want in (("on", "True"), ("off", "False")):
        out = subprocess.run([sys.executable, "-c", probe, state], cwd=REPO, capture_output=True,
                             text=True, check=True, timeout=60).stdout
        assert out.strip() == want, state
