"""Where a CPU hit's Lookup goes: the RPC apart from the engine, and the connector's host work in
a CPU hit (issue 22), on a real offloadd (subprocess, Redis) and a real engine.

    python bench/bench_lookup.py                                # CPU, prompts of 1,024 / 4,096 / 8,000
    python bench/bench_lookup.py --prompt-len 4096 --iters 20 --out bench/results/lookup.json
    python bench/ab_trees.py --before /tmp/before --after . --rounds 3 --out bench/results/x.json \\
        -- bench/bench_lookup.py --iters 10

``rpc``: the same channel's gRPC floor (Health.Check), then Lookups of 1 key and of a prompt's
keys, without and with pins (each lease released, the Release timed apart), back to back, with
the daemon's own handler time per method (its /metrics histogram, mean over the calls).

``cpu_hit``: an engine whose model is tiny (its compute is not what is measured: 2 layers, 32
wide) with the connector, per iteration a new prompt computed cold (and stored), then a CPU hit
after the GPU tier is reset; host wall time of the connector's stages on the engine thread
(medians, ms), with the Lookup RPCs split by the thread that made them: the engine thread's
(``lookup_rpc_engine``: on the hit's critical path) and the connector worker's (``touch_rpc``:
the Lookup without a pin that tells the daemon of a hit loaded from the engine's view, sent
after the step). Both for the default speculative load and for ``ask`` (a pinning Lookup before
the copies).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_offloadd import health_floor, server_side_us  # noqa: E402
from bench.stage_times import StageTimes  # noqa: E402
from offloadd.client import GroupQuery, GroupSpec, OffloadClient  # noqa: E402
from tests.support.offloadd_proc import DaemonProcess  # noqa: E402
from tests.support.redis_proc import RedisProcess  # noqa: E402

BLOCK = 16
# Host work is what is measured: a model whose forward and KV copies are small.
MODEL = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
             num_kv_heads=1, max_position_embeddings=8192 + 128)


def _median_us(fn: Callable[[], object], reps: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def rpc(daemon: DaemonProcess, keys_per_prompt: list[int], reps: int) -> dict[str, Any]:
    """The Lookup RPC apart from any engine: floor, 1 key, N keys, N keys pinned (+ Release)."""
    from bench.bench_offloadd import chain

    slot = 1024
    out: dict[str, Any] = {}
    with OffloadClient(daemon.target) as c:
        c.register_engine("rpc", 1, "rpc", [GroupSpec(0, "full_attention", 0, BLOCK, slot, "bfloat16", "rpc")])
        blocks = chain(max(keys_per_prompt), "rpc")
        for start in range(0, len(blocks), 64):
            res = c.reserve("rpc", 0, blocks[start : start + 64])
            c.commit("rpc", res.reservation_id)
        keys = tuple(b.block_hash for b in blocks)
        out["health_floor_us"] = health_floor(c, reps)[0]
        leases: list[str] = []

        def lookup(q: list[GroupQuery], pin: bool) -> None:
            got = c.lookup("rpc", q, pin=pin)
            if pin:
                leases.append(got.lease_id)

        def release() -> None:
            c.release("rpc", leases.pop())

        out["lookup_1_key_us"] = _median_us(partial(lookup, [GroupQuery(0, keys[:1], True)], False), reps)
        for n in keys_per_prompt:
            q = [GroupQuery(0, keys[:n], True)]
            out[f"lookup_{n}_keys_us"] = _median_us(partial(lookup, q, False), reps)
            out[f"lookup_{n}_keys_pinned_us"] = _median_us(partial(lookup, q, True), reps)
            out[f"release_{n}_keys_us"] = _median_us(release, reps, warmup=0)
            while leases:  # the warm-up's
                release()
        for method in ("Lookup", "Release"):
            out[f"daemon_{method.lower()}_mean_us"] = server_side_us(daemon, method)
    print("--- Lookup RPC apart (us, median): " + json.dumps({k: round(v) for k, v in out.items()}))
    return out


def cpu_hit(daemon: DaemonProcess, workdir: Path, prompt_len: int, iters: int, speculate: bool,
            device: str) -> dict[str, Any]:
    """Host time of the connector's stages in CPU hits (medians, ms) and the hit's wall time."""
    import torch

    from engine.llm import LLM
    from engine.model.checkpoint import TinyModelSpec, write_tiny_model
    from engine.offload.config import OffloadConnectorConfig
    from engine.offload.connector import OffloadingConnector
    from engine.sampling import SamplingParams

    if device == "cpu":
        # Two OpenMP threads on a busy 2-core machine made a 16-token step 20-60x slower in
        # some processes (docs/BENCHMARKS.md); this measures host work, not the forward.
        torch.set_num_threads(1)
    model_dir = write_tiny_model(workdir / "model", TinyModelSpec(**MODEL))  # type: ignore[arg-type]
    conn = OffloadingConnector(OffloadConnectorConfig(daemon.target, f"bench-{prompt_len}-{speculate}",
                                                      "bench", speculate=speculate))
    llm = LLM(str(model_dir), connector=conn, device=device, dtype="float32" if device == "cpu" else "bfloat16",
              num_gpu_blocks=prompt_len // BLOCK * 2 + 16, max_num_batched_tokens=prompt_len + 64,
              max_model_len=prompt_len + 64)
    engine_thread = threading.get_ident()
    times = StageTimes()
    spent = times.spent

    targets = [(conn, "lookup"), (conn, "load"), (conn, "check_loads"), (conn, "store"), (conn, "finish_loads"),
               (conn, "step_done")]
    for obj, name in targets:
        times.wrap(obj, name)
    times.wrap(conn.client, "lookup",
               lambda: "lookup_rpc_engine" if threading.get_ident() == engine_thread else "touch_rpc")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # Prompts of its own per mode: each is computed cold by this engine, not by the other's.
    rng = random.Random(prompt_len * 2 + speculate)
    rows: dict[str, list[float]] = {}
    try:
        for it in range(iters + 1):  # the first warms up
            prompt = [rng.randrange(MODEL["vocab_size"]) for _ in range(prompt_len)]
            llm.generate(prompt, params)
            conn.flush()
            assert llm.reset_prefix_cache()
            spent.clear()
            t0 = time.perf_counter()
            out = llm.generate(prompt, params)
            spent["generate"] = time.perf_counter() - t0
            conn.flush()  # the worker's touch is counted too (after the step)
            hit = out[0].num_external_cached_tokens
            assert hit >= prompt_len - 2 * BLOCK, f"a CPU-tier hit of {hit} tokens of {prompt_len}"
            assert llm.reset_prefix_cache()
            if it:
                for k, v in spent.items():
                    rows.setdefault(k, []).append(v * 1e3)
        stats = conn.stats()
    finally:
        conn.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = dict(device=device, prompt_len=prompt_len, keys=prompt_len // BLOCK, speculate=speculate, iters=iters,
                  stages_ms=med, speculative_loads=stats["speculative_loads"], lookups=stats["lookups"])
    print(f"--- CPU hit, {prompt_len} tokens, {'speculative' if speculate else 'ask'} (ms, median): "
          + json.dumps({k: round(v, 3) for k, v in sorted(med.items(), key=lambda x: -x[1])}))
    return result


def cpu_hit_apart(daemon: DaemonProcess, workdir: Path, prompt_len: int, iters: int, speculate: bool,
                  device: str) -> dict[str, Any]:
    """``cpu_hit`` in a process of its own: after a connector closed, torch's CPU work in the
    process that made it ran many times slower on a busy machine (docs/BENCHMARKS.md)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "case.json"
    case = dict(target=daemon.target, workdir=str(workdir), prompt_len=prompt_len, iters=iters,
                speculate=speculate, device=device, out=str(out))
    subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], check=True)
    return dict(json.loads(out.read_text()))


def _case(spec: str) -> None:
    """The child of :func:`cpu_hit_apart`."""
    c = json.loads(spec)

    class Target:  # what cpu_hit reads of a DaemonProcess
        target = c["target"]

    result = cpu_hit(Target(), Path(c["workdir"]), c["prompt_len"], c["iters"], c["speculate"],  # type: ignore[arg-type]
                     c["device"])
    Path(c["out"]).write_text(json.dumps(result))


def main() -> None:
    if sys.argv[1:2] == ["--case"]:
        _case(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu_hit: the engine's device (default cpu; cuda works)")
    p.add_argument("--prompt-len", default="1024,4096,8000",
                   help="tokens per prompt, comma-separated (default 1024,4096,8000; keys = tokens / 16)")
    p.add_argument("--iters", type=int, default=10, help="CPU hits per prompt length and mode (default 10)")
    p.add_argument("--rpc-reps", type=int, default=300, help="calls per RPC measurement (default 300)")
    p.add_argument("--modes", default="speculative,ask",
                   help="cpu_hit: comma-separated, of speculative (the default load: from the engine's view, "
                        "no RPC first) and ask (a pinning Lookup before the copies)")
    p.add_argument("--skip", choices=["rpc", "cpu_hit"], action="append", default=[], help="leave a part out")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    try:
        plens = [int(x) for x in a.prompt_len.split(",")]
    except ValueError:
        p.error(f"--prompt-len: expected integers separated by commas, got {a.prompt_len!r}")
    if any(n < 2 * BLOCK or n > 8192 for n in plens):
        p.error(f"--prompt-len: each between {2 * BLOCK} and 8192 tokens")
    modes = a.modes.split(",")
    if not modes or not set(modes) <= {"speculative", "ask"}:
        p.error(f"--modes: speculative and/or ask, got {a.modes!r}")
    speculate = [m == "speculative" for m in modes]
    if a.iters < 1 or a.rpc_reps < 20:
        p.error("--iters must be >= 1 and --rpc-reps >= 20")
    work = Path(tempfile.mkdtemp(prefix="bench-lookup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    redis = RedisProcess(work / "redis")
    redis.start()
    daemon = DaemonProcess(work / "offloadd", redis.url, "bench", capacity_bytes=2 << 30, chunk_bytes=1 << 30,
                           metrics=True, extra_args=("--max-request-hashes", "100000"))
    results: dict[str, Any] = {"load_1m_before": os.getloadavg()[0]}
    try:
        daemon.start()
        if "rpc" not in a.skip:
            results["rpc"] = rpc(daemon, [n // BLOCK for n in plens], a.rpc_reps)
        if "cpu_hit" not in a.skip:
            results["cpu_hit"] = [cpu_hit_apart(daemon, work / f"m{n}-{spec}", n, a.iters, spec, a.device)
                                  for n in plens for spec in speculate]
    finally:
        daemon.stop()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    results["load_1m_after"] = os.getloadavg()[0]
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
