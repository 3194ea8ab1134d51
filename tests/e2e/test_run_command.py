"""The README's run command, end to end in its short mode: the whole stack comes up as local
processes, the demo prints its table, and everything stops cleanly (also on SIGTERM)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("REDIS_URL", None)  # the command must start its own redis-server
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


def _started(output: str) -> dict[str, int]:
    """Processes the launcher reported starting: name -> pid."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S+)\s+pid (\d+)", output, re.M)}


def _alive(pids: dict[str, int]) -> list[str]:
    alive = []
    for name, pid in pids.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(name)
    return alive


@pytest.mark.parametrize("command", [["scripts/run", "demo"], ["kvctl", "demo"]], ids=["run", "kvctl"])
def test_run_command_demo_short(tmp_path: Path, command: list[str]) -> None:
    run_dir = tmp_path / "run"
    exe = str(ROOT / command[0]) if command[0].startswith("scripts/") else str(Path(sys.executable).parent / command[0])
    proc = subprocess.run(
        [exe, command[1], "--short", f"--run-dir={run_dir}", f"--arena-dir={tmp_path / 'arena'}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    rows = {m.group(1): int(m.group(2)) for m in re.finditer(r"^  (miss|GPU hit|CPU hit)\s+(\d+)", out, re.M)}
    assert rows["miss"] > 0 and rows["GPU hit"] > 0 and rows["CPU hit"] > 0, out
    # every request went through kv-router, which says where and why; both engines served some
    routed = re.findall(r"^  \[\s*\d+/\d+\] \S+ \S+\s+-> (engine-\d)\s+(\w+)", out, re.M)
    assert {engine for engine, _ in routed} == {"engine-0", "engine-1"}, out
    assert {"gpu_prefix", "no_prefix"} <= {reason for _, reason in routed}, out
    shared = re.search(r"requests served from prefixes another engine computed: (\d+)", out)
    assert shared is not None and int(shared.group(1)) >= 1, out  # the host tier is the node's
    exact = re.search(r"kv-router predicted the cached prefix exactly for (\d+) of (\d+) requests", out)
    assert exact is not None and int(exact.group(1)) >= int(exact.group(2)) * 0.8, out
    # the router's view (bridge -> subscriber) shows both engines' GPU tiers and the CPU tier
    assert re.search(r"engine-0\s+GPU", out) and re.search(r"engine-1\s+GPU", out)
    assert re.search(r"offloadd\s+CPU\s+group 0\s+\d+ blocks", out)
    assert (run_dir / "demo-timeline.png").stat().st_size > 10_000
    for name in ("redis", "offloadd", "kv-bridge", "engine-0", "engine-1", "kv-router"):
        assert (run_dir / f"{name}.log").exists(), name
    assert out.rstrip().endswith("kv-stack: stopped")
    started = _started(out)
    assert set(started) == {"redis", "offloadd", "kv-bridge", "engine-0", "engine-1", "kv-router"}, out
    assert _alive(started) == []


def test_run_command_stops_everything_on_sigterm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "run"), "up", "--no-demo", f"--run-dir={run_dir}",
         f"--arena-dir={tmp_path / 'arena'}"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "the stack is up" in line:
                break
        assert any("the stack is up" in line for line in lines), "".join(lines)
        started = _started("".join(lines))
        assert set(started) == {"redis", "offloadd", "kv-bridge", "engine-0", "engine-1", "kv-router"}, "".join(lines)
        assert _alive(started) == list(started)
        assert "next:" in "".join(lines) and "/v1/completions" in "".join(lines)  # what to try
        _examples_work_against("".join(lines))
        # a second stack on the same namespace and arena files is refused before it starts anything
        second = subprocess.run(
            [sys.executable, "-m", "stack", "up", "--no-demo", f"--run-dir={tmp_path / 'run2'}",
             f"--arena-dir={tmp_path / 'arena'}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
            timeout=120)
        assert second.returncode == 1, second.stdout + second.stderr
        assert "namespace 'demo' in " in second.stderr and "in use by another kv-stack (pid " in second.stderr
        assert "Traceback" not in second.stderr and "  redis " not in second.stdout
        assert any((tmp_path / "arena").glob("kvd-demo-L*")), "the first stack's arena is untouched"
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "kv-stack: stopped" in rest
        assert _alive(started) == []
        assert sorted(p.name for p in (tmp_path / "arena").iterdir()) == []  # shared memory freed
    finally:
        if proc.poll() is None:  # a failed assertion must not leave the stack running
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def _examples_work_against(banner: str) -> None:
    """The README's example gRPC client and ZMQ subscriber, run as a user would."""
    engine = re.search(r"engine-0\s+(\S+) \(gRPC Generate\)", banner)
    bridge = re.search(r"PUB (\S+)\s+replay (\S+)", banner)
    assert engine and bridge, banner
    gen = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate_client.py"), "--target", engine.group(1),
         "--max-tokens", "4", "Document 1. The cache block engine"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )
    assert gen.returncode == 0, gen.stderr
    assert re.search(r"\[(length|eos|stop); prompt 34 tokens, 0 from the GPU cache", gen.stdout), gen.stdout
    sub = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "zmq_subscriber.py"), "--pub", bridge.group(1),
         "--replay", bridge.group(2), "--seconds", "2"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )
    assert sub.returncode == 0, sub.stderr
    # the prompt's 2 full blocks are resident on engine-0's GPU tier and stored in the CPU tier
    assert re.search(r"^engine-0\s+GPU  2 blocks$", sub.stdout, re.M), sub.stdout
    assert re.search(r"^offloadd\s+CPU  2 blocks$", sub.stdout, re.M), sub.stdout
    # and an OpenAI client through kv-router (after the counts above: this adds a block)
    router_url = re.search(r"router\s+(\S+)/v1 \(OpenAI HTTP", banner)
    assert router_url, banner
    with openai.OpenAI(base_url=f"{router_url.group(1)}/v1", api_key="none", max_retries=0) as client:
        out = client.completions.create(model="demo", prompt="Through the router", max_tokens=2)
        assert out.usage is not None and out.usage.prompt_tokens == 18
