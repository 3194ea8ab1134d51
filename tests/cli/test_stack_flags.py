"""kv-stack refuses what it cannot run before it starts anything, in one line: a run directory
it cannot create (was a traceback), a --model without config.json (was: a random model written
there and the demo run on it), no engines or no GPU blocks (was: a failure after redis, offloadd
and the bridge had started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _stack(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stack", "demo", "--short", f"--arena-dir={tmp_path / 'arena'}",
                           *args], capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("args, code, message", [
    (["--engines", "0"], 2, "kv-stack: error: --engines must be >= 1, got 0"),
    (["--gpu-blocks", "-3"], 2, "kv-stack: error: --gpu-blocks must be >= 1, got -3"),
    (["--model", "{tmp}/no-model"], 2,
     "kv-stack: error: --model {tmp}/no-model: no config.json there (a Hugging Face model directory)"),
    (["--run-dir", "/etc/hostname/run"], 1,
     "kv-stack: error: cannot use the run directory /etc/hostname/run: [Errno 20] Not a directory: "
     "'/etc/hostname/run'"),
])
def test_refused_before_anything_starts(tmp_path: Path, args: list[str], code: int, message: str) -> None:
    out = _stack(tmp_path, *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (code, message.replace("{tmp}", str(tmp_path)))
    assert "Traceback" not in out.stderr and " pid " not in out.stdout  # no process was started
    assert not (tmp_path / "no-model").exists() and not (tmp_path / "arena").exists()
