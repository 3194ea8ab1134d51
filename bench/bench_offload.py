"""Host-tier offload benchmark: scattered-block copy bandwidth, and TTFT cold / GPU hit / CPU hit.

    python bench/bench_offload.py bandwidth --device cuda        # vs the pinned-copy limit
    python bench/bench_offload.py ttft --device cuda --model 1b  # needs redis-server on PATH
    python bench/bench_offload.py all --device cpu --out results.json
    python bench/bench_offload.py ttft --device cpu --model 1b-kv-narrow --prompt-len 4096

``bandwidth`` moves N blocks between a KV tensor and arena slots in random (scattered) order with
the connector's own batched copies (engine.offload.copies), and in the same run measures the
limit: one contiguous copy of the same bytes between device memory and pinned host memory (on
CPU: one contiguous memcpy). ``ttft`` runs a real offloadd (subprocess, Redis) and an engine with
the real connector; per iteration a new prompt: cold, GPU hit, reset, CPU hit. ``1b-kv-narrow``
has the 1B model's KV geometry and narrow layers, so that on a CPU the engine's per-request
work outside the model shows (``--profile`` prints where a GPU hit and a CPU hit spend it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.dense_forward import time_dense  # noqa: E402
from bench.stage_times import StageTimes  # noqa: E402
from engine.offload.config import COPY_MODES  # noqa: E402
from engine.offload.copies import ArenaBlocks  # noqa: E402
from engine.offload.cuda_runtime import (  # noqa: E402
    CUDA_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
    loaded_cudart,
    runtime_version,
)
from offloadd.arena import ArenaGeometry, ArenaMapping, create_chunk_file  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B's shape with a smaller vocabulary (the vocabulary does not touch the KV).
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
               num_heads=32, num_kv_heads=8, max_position_embeddings=8192, init_std=0.02,
               save_dtype="bfloat16"),
    # The 1B model's KV geometry (16 layers x 8 KV heads x 64 dims) with narrow layers: on CPU,
    # per-request engine overhead is then not hidden under the model's FLOPs.
    "1b-kv-narrow": dict(vocab_size=512, hidden_size=512, intermediate_size=512, num_layers=16,
                         num_heads=8, num_kv_heads=8, max_position_embeddings=8192),
    "tiny-plain": dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=4,
                       num_heads=8, num_kv_heads=2, max_position_embeddings=4096),
    "tiny-hybrid": dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=4,
                        num_heads=8, num_kv_heads=2, max_position_embeddings=4096, hybrid=True,
                        sliding_window=128),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


DEFAULT_MODES = "auto,kernel,memcpy,memcpy-2,batch,batch-overlap,mixed-0.6,mixed-0.75,mixed-0.9"


def parse_mode(spec: str) -> tuple[str, dict[str, Any]]:
    """A ``--modes`` entry as (copy_mode, ArenaBlocks knobs): ``memcpy-N`` / ``batch-N``: N DMA
    streams; ``mixed-S``: DMA share S of the blocks (``mixed-S-N``: over N streams); a trailing
    ``-overlap``: cudaMemcpyFlagPreferOverlapWithCompute on the batch copies."""
    base, *rest = spec.split("-")
    if base not in COPY_MODES:
        raise ValueError(f"unknown copy mode {spec!r}: the modes are {', '.join(COPY_MODES)}")
    knobs: dict[str, Any] = {}
    try:
        for part in rest:
            if part == "overlap":
                knobs["batch_flags"] = CUDA_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
            elif base == "mixed" and "dma_share" not in knobs:
                knobs["dma_share"] = float(part)
            else:
                knobs["num_dma_streams"] = int(part)
    except ValueError:
        raise ValueError(f"bad copy mode {spec!r}: expected e.g. memcpy-2, batch-overlap, mixed-0.75") from None
    return base, knobs


def bandwidth(device: torch.device, num_blocks: int, block_shape: tuple[int, ...],
              arena_dir: str, reps: int, modes: list[str]) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = torch.randn((num_blocks * 2 + 1, *block_shape), device=device).to(dtype)
    block_bytes = kv[0].numel() * kv.element_size()
    nbytes = num_blocks * block_bytes
    spc = max(1, (256 << 20) // block_bytes)
    max_slots = num_blocks * 2
    nchunks = -(-max_slots // spc)
    geometry = ArenaGeometry(block_bytes, spc, nchunks * spc, os.path.join(arena_dir, "bench-C{chunk}"))
    for c in range(nchunks):
        create_chunk_file(geometry.chunk_path(c), geometry.chunk_file_bytes, 0o600, None)
    rng = random.Random(0)
    ids = rng.sample(range(1, num_blocks * 2 + 1), num_blocks)
    scattered = rng.sample(range(max_slots), num_blocks)
    first = rng.randrange(max_slots - num_blocks)
    runs = list(range(first, first + num_blocks))  # as fresh reservations come
    rows: list[dict[str, Any]] = []
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    limit_store = nbytes / _timed(lambda: pinned.copy_(flat, non_blocking=True), device, reps)
    limit_load = nbytes / _timed(lambda: flat.copy_(pinned, non_blocking=True), device, reps)
    # The arena's own contiguous limit: whole chunk files to/from device memory, one copy each
    # (registered shared-memory pages can behave unlike cudaHostAlloc'd ones).
    probe = ArenaBlocks(ArenaMapping(geometry), block_shape, dtype, device)
    chunks = [probe.host_chunk(c).view(-1).view(torch.uint8) for c in range(nchunks)]
    sizes = [min(c.numel(), nbytes - i * c.numel()) for i, c in enumerate(chunks)]

    def arena_copy(to_host: bool) -> None:
        off = 0
        for c, n in zip(chunks, sizes, strict=True):
            if n <= 0:
                break
            if to_host:
                c[:n].copy_(flat[off : off + n], non_blocking=True)
            else:
                flat[off : off + n].copy_(c[:n], non_blocking=True)
            off += n

    arena_store = nbytes / _timed(lambda: arena_copy(True), device, reps)
    arena_load = nbytes / _timed(lambda: arena_copy(False), device, reps)
    chunks.clear()
    probe.close()
    probe.mapping.close()
    cases = [(m, name, sl) for name, sl in (("scattered", scattered), ("runs", runs))
             for m in (modes if device.type == "cuda" else ["cpu"])]
    for mode, slot_kind, slots in cases:
        base_mode, knobs = parse_mode(mode) if mode != "cpu" else ("auto", {})
        arena = ArenaBlocks(ArenaMapping(geometry), block_shape, dtype, device, base_mode, **knobs)
        store = nbytes / _timed(lambda a=arena, s=slots: a.write(a.gather(kv, ids), s), device, reps)
        dst = kv.clone()
        load = nbytes / _timed(lambda a=arena, d=dst, s=slots: a.read(d, ids, s), device, reps)
        ok = torch.equal(dst[ids], kv[ids])
        rows.append(dict(mode=mode, mode_used=arena.copy_mode if arena.copy_mode == "kernel" else f"{arena.copy_mode}/{arena.dma_path}", knobs=knobs, slots=slot_kind, blocks=num_blocks, block_bytes=block_bytes, bytes=nbytes,
                         store_GBps=store / 1e9, load_GBps=load / 1e9,
                         limit_store_GBps=limit_store / 1e9, limit_load_GBps=limit_load / 1e9,
                         store_ratio=store / limit_store, load_ratio=load / limit_load,
                         arena_limit_store_GBps=arena_store / 1e9, arena_limit_load_GBps=arena_load / 1e9,
                         correct=ok))
        arena.close()
        arena.mapping.close()
    rows += _layer_loads(kv, ids, scattered, runs, geometry, block_shape, dtype, device, reps, rng,
                         nbytes, limit_store, limit_load)
    for c in range(nchunks):
        os.unlink(geometry.chunk_path(c))
    return rows


def _layer_loads(kv: torch.Tensor, ids: list[int], scattered: list[int], runs: list[int], geometry: Any,
                 block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, reps: int,
                 rng: random.Random, nbytes: int, limit_store: float, limit_load: float) -> list[dict[str, Any]]:
    """The layer-by-layer load as the engine issues it (engine.offload.layerwise, every copy
    issued and then waited for), in units halving toward the last layer (mode ``layers``) and
    one layer a copy (``per-layer``): scattered slots into random block ids (one gather kernel
    per copy), and a run of slots into a run of block ids, as fresh blocks are handed out (one
    2-D DMA copy per unit)."""
    from engine.offload.layer_plan import GroupLoad
    from engine.offload.layerwise import LayerLoader

    arena = ArenaBlocks(ArenaMapping(geometry), block_shape, dtype, device)
    first = rng.randrange(1, kv.shape[0] - len(ids) + 1)
    rows = []
    for name, slot_kind, slots, dst_ids in [(name, k, s, d) for name in ("layers", "per-layer")
                                            for k, s, d in (("scattered", scattered, ids),
                                                            ("runs", runs, list(range(first, first + len(ids)))))]:
        loader = LayerLoader(device, halving=name == "layers")
        arena.write(arena.gather(kv, ids), slots)
        dst = torch.zeros_like(kv)

        def load_all(s: list[int] = slots, d: list[int] = dst_ids, out: torch.Tensor = dst,
                     ld: LayerLoader = loader) -> None:
            loads = ld.new_step()
            ld.load([GroupLoad(0, arena, out, d, s)], loads)
            loads.finish()

        load = nbytes / _timed(load_all, device, reps)
        rows.append(dict(mode=name, mode_used="/".join(sorted(loader.issued)), knobs={}, slots=slot_kind,
                         blocks=len(ids), block_bytes=nbytes // len(ids), bytes=nbytes,
                         store_GBps=float("nan"), load_GBps=load / 1e9,
                         limit_store_GBps=limit_store / 1e9, limit_load_GBps=limit_load / 1e9,
                         store_ratio=float("nan"), load_ratio=load / limit_load,
                         correct=torch.equal(dst[dst_ids], kv[ids])))
    arena.close()
    arena.mapping.close()
    return rows


def _profile(llm: Any, conn: Any, rng: random.Random, vocab: int, n: int, params: Any) -> None:
    """Where a cold prefill, a GPU hit and a CPU hit spend their time (cProfile, top functions
    by own time)."""
    import cProfile
    import pstats

    prompt = [rng.randrange(vocab) for _ in range(n)]
    for name in ("cold", "gpu_hit", "cpu_hit"):
        # The previous request's store runs on the connector's worker thread: wait for it, or
        # the profile shows this thread waiting for the GIL (in whatever it happened to call).
        conn.flush()
        if name == "cpu_hit":
            llm.reset_prefix_cache()
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompt, params)
        prof.disable()
        print(f"--- profile: {name}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(r"engine|offloadd", 25)
    if torch.cuda.is_available() and llm.engine.device.type == "cuda":
        # The GPU's side of a CPU hit: copies, the step, and the gaps between them.
        from torch.profiler import ProfilerActivity, profile

        conn.flush()
        llm.reset_prefix_cache()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            llm.generate(prompt, params)
            torch.cuda.synchronize()
        print("--- torch profile: cpu_hit")
        print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))
        events = sorted((e for e in tp.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        if events:
            t0 = events[0].time_range.start
            print("--- CUDA timeline (us from the first GPU op): start, duration, name; gaps > 50 us marked")
            prev_end = t0
            for e in events:
                gap = e.time_range.start - prev_end
                mark = f"GAP {gap:.0f} " if gap > 50 else ""
                if gap > 50 or e.time_range.elapsed_us() > 100:
                    print(f"{e.time_range.start - t0:9.0f} {e.time_range.elapsed_us():8.0f} {mark}{e.name[:60]}")
                prev_end = max(prev_end, e.time_range.end)
            print(f"last GPU op ends at {prev_end - t0:.0f} us")
            # How busy the GPU was over time: copies and compute (kernels) per 250 us window.
            width = 250.0
            busy: dict[int, list[float]] = {}
            for e in events:
                kind = 0 if e.name.startswith("Memcpy") else 1
                a, b = e.time_range.start - t0, e.time_range.end - t0
                w = int(a // width)
                while a < b:
                    end = min(b, (w + 1) * width)
                    busy.setdefault(w, [0.0, 0.0, 0])[kind] += end - a
                    a, w = end, w + 1
                busy[int((e.time_range.start - t0) // width)][2] += kind
            print("--- GPU busy per 250 us window: start, copy us, kernel us, kernels started")
            for w in sorted(busy):
                c, k, n = busy[w]
                print(f"{w * width:9.0f} {c:6.0f} {k:6.0f} {n:5.0f}")
            # The host's side: CUDA runtime calls (same clock), to see when work was issued.
            calls = sorted((e for e in tp.events() if e.device_type.name == "CPU" and e.name.startswith("cuda")),
                           key=lambda e: e.time_range.start)
            shown: dict[str, int] = {}
            print("--- CUDA runtime calls on the host (us from the first GPU op): start, duration, name")
            for e in calls:
                n = shown.get(e.name, 0)
                if n < 4 or e.time_range.elapsed_us() > 50:
                    print(f"{e.time_range.start - t0:9.0f} {e.time_range.elapsed_us():8.0f} {e.name[:50]}")
                shown[e.name] = n + 1
            print("calls: " + ", ".join(f"{k} x{v}" for k, v in shown.items()))


def _breakdown(llm: Any, conn: Any, prompt: list[int], params: Any, reps: int = 5) -> dict[str, dict[str, float]]:
    """Host wall time per engine stage of a cold prefill, a GPU hit and a CPU hit (medians, ms), by timing
    wrappers set on this engine's instances for the measurement (no profiler overhead). The offload
    client's calls count as ``lookup_rpc`` on the engine thread, ``lookup_rpc_worker`` on the
    connector's worker (after the step: not on the hit's path)."""
    e = llm.engine
    targets = [(e, "prepare_prompt"), (e, "add_prepared"), (e, "step"), (e.kv, "find_prefix_hit"),
               (e.kv, "allocate_for_admission"), (e.connector, "lookup"), (e.connector, "load"),
               (e.connector.client, "lookup"), (e.connector, "check_loads"),
               (e.runner, "execute"), (e.connector, "store"), (e.connector, "take_layer_waits"), (e.connector, "step_done"),
               (e, "_append_token"), (e, "_flush_events"),
               (e.kv, "register_full_blocks"), (e.scheduler, "schedule")]
    times = StageTimes()
    spent = times.spent
    engine_thread = threading.get_ident()

    def rpc_label(name: str) -> Any:
        # The client is also called by the connector's worker (its Lookup without a pin that
        # reports a hit loaded from the view, after the step): that is not on the hit's path.
        return lambda: f"{name}_rpc" if threading.get_ident() == engine_thread else f"{name}_rpc_worker"

    for obj, name in targets:
        times.wrap(obj, name, rpc_label(name) if obj is e.connector.client else name)
    out: dict[str, dict[str, float]] = {}
    rng = random.Random(len(prompt))
    rows: dict[str, dict[str, list[float]]] = {"cold": {}, "gpu_hit": {}, "cpu_hit": {}}
    try:
        # As the TTFT loop does: a new prompt each time, computed cold and stored, then a GPU
        # hit and a CPU hit (the same prompt over and over measured up to 1.5 ms less).
        for _ in range(reps):
            fresh = [rng.randrange(max(prompt) + 1) for _ in prompt]
            for kind in ("cold", "gpu_hit", "cpu_hit"):
                if kind == "cpu_hit":
                    llm.reset_prefix_cache()
                spent.clear()
                t0 = time.perf_counter()
                llm.generate(fresh, params)
                spent["generate"] = time.perf_counter() - t0
                conn.flush()  # the worker's calls of this request are counted apart (rpc_label)
                for k, v in spent.items():
                    rows[kind].setdefault(k, []).append(v * 1e3)
            llm.reset_prefix_cache()
        out = {kind: {k: statistics.median(v) for k, v in r.items()} for kind, r in rows.items()}
    finally:
        for obj, name in targets:
            delattr(obj, name)  # back to the class's method
    print("--- host time per stage (ms, median): " + ", ".join(f"{k}: {json.dumps({n: round(v, 3) for n, v in sorted(d.items(), key=lambda x: -x[1])})}" for k, d in out.items()))
    return out


def _lookup_rpc(llm: Any, conn: Any, prompt: list[int], reps: int = 30) -> dict[str, float]:
    """The lookup RPC made apart from the engine's step, medians in ms: 1 key (the gRPC floor),
    every full block of the prompt without pins, and with pins (each lease released after),
    back to back; and the last once more with 5 ms of idleness before each call, as an
    admission sees it (the client and the daemon wait in between)."""
    from offloadd.client import GroupQuery

    keys = tuple(llm.engine.hasher.hash_blocks(prompt))
    engine_id, client = conn.config.engine_id, conn.client
    out: dict[str, float] = {}
    for name, ks, pin, idle in (("1_key", keys[:1], False, 0.0), ("all_keys", keys, False, 0.0),
                                ("all_keys_pinned", keys, True, 0.0),
                                ("all_keys_pinned_after_5ms_idle", keys, True, 0.005)):
        times = []
        for _ in range(reps):
            time.sleep(idle)
            t0 = time.perf_counter()
            got = client.lookup(engine_id, [GroupQuery(0, ks, True)], pin=pin)
            times.append(time.perf_counter() - t0)
            if got.lease_id:
                client.release(engine_id, got.lease_id)
        out[name] = statistics.median(times) * 1e3
    print("--- lookup RPC apart from the step (ms, median): " + json.dumps({k: round(v, 3) for k, v in out.items()}))
    return out


def _decode_step(llm: Any, prompt: list[int], reps: int = 3) -> float:
    """Seconds of one decode step at batch 1 after this prompt: the median wall time of the
    engine's decode steps in ``reps`` generations of 17 tokens (GPU hits of the same prompt;
    each step ends with its token on the host)."""
    from engine.sampling import SamplingParams

    more = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    e = llm.engine
    step, steps = e.step, []

    def timed() -> Any:
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(time.perf_counter() - t0)

    e.step = timed
    try:
        decodes: list[float] = []
        for _ in range(reps):
            steps.clear()
            llm.generate(prompt, more)
            decodes += steps[1:]  # the first step is the prompt's (a GPU hit)
    finally:
        del e.step
    return statistics.median(decodes)


def ttft(device: torch.device, model: str, prompt_len: int, iters: int, workdir: Path,
         limit_load_GBps: float | None, profile: bool = False, eager: bool = False,
         layerwise: bool = True, speculate: bool = True, layer_copies: Literal["halving", "per-layer"] = "halving") -> dict[str, Any]:
    from engine.llm import LLM
    from engine.model.checkpoint import TinyModelSpec, write_tiny_model
    from engine.offload.config import OffloadConnectorConfig
    from engine.offload.connector import OffloadingConnector
    from engine.sampling import SamplingParams
    from tests.support.offloadd_proc import DaemonProcess
    from tests.support.redis_proc import RedisProcess

    spec = MODELS[model]
    model_dir = write_tiny_model(workdir / model, TinyModelSpec(**spec))
    redis = RedisProcess(workdir / "redis")
    redis.start()
    kv_token_bytes = 0
    daemon = DaemonProcess(workdir / "offloadd", redis.url, "bench", capacity_bytes=8 << 30,
                           chunk_bytes=1 << 30)
    daemon.arena_dir = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    daemon.args[daemon.args.index("--arena-dir") + 1] = str(daemon.arena_dir)
    daemon.start()
    try:
        conn = OffloadingConnector(OffloadConnectorConfig(daemon.target, "bench-0", model, layerwise=layerwise,
                                                          speculate=speculate,
                                                          layer_copies=layer_copies))
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        llm = LLM(str(model_dir), connector=conn, device=str(device), dtype=dtype,
                  num_gpu_blocks=prompt_len // 16 * 2 + 16, max_num_batched_tokens=prompt_len + 64,
                  max_model_len=prompt_len + 64, enforce_eager=eager)
        kv_token_bytes = sum(g.block_bytes for g in llm.engine.kv_groups) // 16
        # The minimal dense forward of the same weights (bench/dense_forward.py), before and
        # after the TTFT loop; the faster of the two medians is kept.
        dense = time_dense(llm.engine.model, prompt_len, max(3, iters))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rng = random.Random(1)
        vocab = spec["vocab_size"]
        times: dict[str, list[float]] = {"cold": [], "gpu_hit": [], "cpu_hit": []}
        for it in range(iters + 1):  # the first iteration warms up and is not counted
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            sample: dict[str, float] = {}
            for name in ("cold", "gpu_hit"):
                t0 = time.perf_counter()
                llm.generate(prompt, params)
                sample[name] = time.perf_counter() - t0
                # Let the background store finish so that it does not share the next
                # measurement (one Python process: the worker competes for the GIL).
                conn.flush()
            assert llm.reset_prefix_cache()
            t0 = time.perf_counter()
            out = llm.generate(prompt, params)
            sample["cpu_hit"] = time.perf_counter() - t0
            assert out[0].num_external_cached_tokens > 0, "no CPU-tier hit"
            conn.flush()
            assert llm.reset_prefix_cache()
            if it:
                for k, v in sample.items():
                    times[k].append(v)
        dense = {k: min(v, w) for (k, v), w in zip(dense.items(), time_dense(llm.engine.model, prompt_len,
                                                                              max(3, iters)).values(), strict=True)}
        llm.generate(prompt, params)
        conn.flush()
        decode_s = _decode_step(llm, prompt)
        stages = _breakdown(llm, conn, prompt, params)
        llm.generate(prompt, params)
        conn.flush()  # the prompt's blocks are all in the host tier
        rpc = _lookup_rpc(llm, conn, prompt)
        if profile:
            _profile(llm, conn, rng, vocab, prompt_len, params)
        med = {k: statistics.median(v) for k, v in times.items()}
        graphs = llm.engine.runner.graphs
        kv_bytes = kv_token_bytes * prompt_len
        result: dict[str, Any] = dict(model=model, device=str(device), prompt_len=prompt_len,
                                      iters=iters, kv_bytes=kv_bytes, eager=graphs is None, layerwise=layerwise,
                                      speculate=speculate, layer_copies=layer_copies,
                                      graph_steps=graphs.steps if graphs else 0,
                                      graph_captures=graphs.captures if graphs else 0,
                                      decode_step_ms=decode_s * 1e3, host_stages_ms=stages, lookup_rpc_ms=rpc,
                                      **{f"{k}_ms": v * 1e3 for k, v in med.items()},
                                      cold_over_cpu_hit=med["cold"] / med["cpu_hit"],
                                      **dense, cold_over_dense=med["cold"] * 1e3 / dense["dense_ms"],
                                      dense_over_cpu_hit=dense["dense_ms"] / (med["cpu_hit"] * 1e3),
                                      cpu_hit_wins=sum(c > h for c, h in zip(times["cold"], times["cpu_hit"], strict=True)),
                                      connector=conn.stats())
        if limit_load_GBps:
            # The bound: the KV bytes at the pinned limit plus one decode step.
            bound = kv_bytes / (limit_load_GBps * 1e9) + decode_s
            result.update(bound_ms=bound * 1e3, cpu_hit_over_bound=med["cpu_hit"] / bound)
        conn.close()
        return result
    finally:
        daemon.stop()
        redis.stop()
        # The arena outlives the daemon by design (recovery); this one is ours to remove.
        shutil.rmtree(daemon.arena_dir, ignore_errors=True)


def _cold_fit(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per model and engine mode with 2+ prompt lengths: least-squares ``cold = fixed + per_token
    * n``, and the same for the dense forward (the engine's fixed cost beyond the forward)."""
    out: dict[str, dict[str, float]] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(f"{r['model']} eager={r['eager']} layerwise={r['layerwise']} speculate={r['speculate']}", []).append(r)
    for key, rs in groups.items():
        if len({r["prompt_len"] for r in rs}) < 2:
            continue
        fit = {}
        for col in ("cold_ms", "dense_ms"):
            xs, ys = [r["prompt_len"] for r in rs], [r[col] for r in rs]
            slope, intercept = statistics.linear_regression(xs, ys)
            fit[f"{col[:-3]}_fixed_ms"], fit[f"{col[:-3]}_us_per_token"] = intercept, slope * 1e3
        out[key] = fit
        print(f"fit {key}: " + ", ".join(f"{k} {v:.2f}" for k, v in fit.items()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["bandwidth", "ttft", "all"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="1b, tiny-plain, tiny-hybrid (default: by device)")
    p.add_argument("--prompt-len", default=None,
                   help="ttft: tokens per prompt, comma-separated for several (default 4096 on CUDA, 1024 on CPU)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--blocks", type=int, default=None)
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated, of {', '.join(COPY_MODES)}; memcpy-N / batch-N: N DMA streams; "
                        "mixed-S: DMA share S of the blocks; -overlap: batch flag PreferOverlapWithCompute")
    p.add_argument("--arena-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    p.add_argument("--profile", action="store_true", help="cProfile one GPU hit and one CPU hit")
    p.add_argument("--engines", default="graphs",
                   help="ttft: comma-separated engine modes, run one after the other: graphs (default: small "
                        "steps replay CUDA graphs), eager (enforce_eager); a -whole suffix turns the "
                        "layer-by-layer load off (the copy completes before the step), an -ask suffix "
                        "the speculative load (the copy waits for the pinning Lookup's answer), a -perlayer "
                        "suffix copies a layer-by-layer load one layer a call (default: units halving "
                        "toward the last layer)")
    p.add_argument("--limit-load-gbps", type=float, default=None,
                   help="pinned load limit for the TTFT bound when `bandwidth` is not run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    modes = a.modes.split(",")
    for m in modes:
        try:
            parse_mode(m)
        except ValueError as e:
            p.error(str(e))
    device = torch.device(a.device)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    limit = a.limit_load_gbps
    if a.what in ("bandwidth", "all"):
        # The 1B model's block: 16 layers x K,V x 16 tokens x 8 heads x 64 dims (512 KiB bf16).
        shape = (16, 2, 16, 8, 64) if device.type == "cuda" else (4, 2, 16, 2, 64)
        blocks = a.blocks or (2048 if device.type == "cuda" else 1024)
        rows = bandwidth(device, blocks, shape, a.arena_dir, 5, modes)
        results["bandwidth"] = rows
        if device.type == "cuda":  # batch needs >= 12080; "used" shows a fallback to memcpy
            lib = loaded_cudart()
            results["cudart_version"] = runtime_version(lib) if lib is not None else 0
            print(f"CUDA runtime {results['cudart_version']}")
        print(f"{'slots':9} {'mode':18} {'used':13} {'MiB':>7} {'store GB/s':>10} {'limit':>7} {'ratio':>6} {'load GB/s':>10} {'limit':>7} {'ratio':>6} ok")
        for r in rows:
            print(f"{r['slots']:9} {r['mode']:18} {r['mode_used']:13} {r['bytes'] / 2**20:7.0f} {r['store_GBps']:10.2f} {r['limit_store_GBps']:7.2f} "
                  f"{r['store_ratio']:6.2f} {r['load_GBps']:10.2f} {r['limit_load_GBps']:7.2f} {r['load_ratio']:6.2f} {r['correct']}")
        print(f"contiguous copies of whole arena chunk files (the arena's own limit): "
              f"store {rows[0]['arena_limit_store_GBps']:.2f} GB/s, load {rows[0]['arena_limit_load_GBps']:.2f} GB/s")
        limit = rows[0]["limit_load_GBps"]
    if a.what in ("ttft", "all"):
        models = [a.model] if a.model else (["1b"] if device.type == "cuda" else ["tiny-plain", "tiny-hybrid"])
        try:
            plens = [int(x) for x in a.prompt_len.split(",")] if a.prompt_len else [4096 if device.type == "cuda" else 1024]
        except ValueError:
            p.error(f"--prompt-len: expected integers separated by commas, got {a.prompt_len!r}")
        results["ttft"] = []
        for m, mode, plen in [(m, e, n) for m in models for e in a.engines.split(",") for n in plens]:
            base, *suffixes = mode.split("-")
            if base not in ("graphs", "eager") or not set(suffixes) <= {"whole", "ask", "perlayer"}:
                p.error(f"--engines: unknown mode {mode!r} (graphs or eager, then -whole, -ask, -perlayer)")
            with tempfile.TemporaryDirectory() as tmp:
                r = ttft(device, m, plen, a.iters, Path(tmp), limit, a.profile,
                         eager=base == "eager", layerwise="whole" not in suffixes, speculate="ask" not in suffixes,
                         layer_copies="per-layer" if "perlayer" in suffixes else "halving")
            results["ttft"].append(r)
            print(f"{m} [{mode}, {r['graph_steps']} grid steps, {r['graph_captures']} captures]: prompt {plen}  cold {r['cold_ms']:.1f} ms  GPU hit {r['gpu_hit_ms']:.1f} ms  "
                  f"CPU hit {r['cpu_hit_ms']:.1f} ms  cold/CPU-hit {r['cold_over_cpu_hit']:.1f}x  "
                  f"wins {r['cpu_hit_wins']}/{a.iters}  decode step {r['decode_step_ms']:.2f} ms"
                  + (f"  bound {r['bound_ms']:.1f} ms (CPU hit / bound {r['cpu_hit_over_bound']:.2f})" if "bound_ms" in r else "")
                  + f"  dense {r['dense_ms']:.1f} ms (cold / dense {r['cold_over_dense']:.2f}, dense / CPU hit "
                    f"{r['dense_over_cpu_hit']:.1f}x)  bare {r['bare_ms']:.1f} ms")
        results["cold_fit"] = _cold_fit(results["ttft"])
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
