"""The load benchmark, short: 4 synthetic engines for 8 s (bench/bench_load.py does the checks:
zero loss, exactly once, Snapshot == reducer over the log, served bytes exact)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.offloadd_proc import REPO


def test_four_engines_short_load_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "bench/bench_load.py", "--seconds", "8", "--pub-pause-ms", "4",
         "--store-pause-ms", "8", "--no-write", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["ok"] and r["failures"] == [] and r["flushed"]
    assert r["batches"] > 1000 and r["blocks_committed"] > 1000
    assert r["log_records"] >= r["batches"]
    # Bounded state (resident sets, arena), so the daemon's memory is bounded too.
    assert r["rss_max_mib"] < 400, r["rss_kb"]


def test_bad_arguments_are_refused() -> None:
    proc = subprocess.run([sys.executable, "bench/bench_load.py", "--seconds", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "bench_load: --seconds must be > 0 and --engines >= 1"
