"""Where the engine's time goes on CUDA: cold prefills and decode steps, no offload daemon.

    python bench/profile_engine.py [--lengths 1024,4096,8000] [--out profile.txt]

For the bench_offload ``1b`` model (bf16): the wall time of cold prefills next to the engine
model's own dense forward at each length; then for one cold 4096-token prefill and for decode
steps (batch 1 and 32, short and long contexts) a torch.profiler CUDA table (kernels by total
time), the GPU's span and busy time against the host's, gaps over 30 us, and a cProfile of
the host side. Prints to stdout (or ``--out``); profiles are not timings: the numbers to report
come from bench_offload and bench_engine.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_offload import MODELS
from engine.llm import LLM
from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from engine.model.llama import DenseCausalAttention
from engine.sampling import SamplingParams


def timeline(fn: Callable[[], object], label: str) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    gpu = sorted((e for e in tp.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    first_host = min(e.time_range.start for e in tp.events() if e.device_type.name == "CPU")
    t0 = gpu[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in gpu)
    print(f"=== {label}: wall (profiled) {wall * 1e3:.2f} ms, first GPU op {t0 - first_host:.0f} us after the first "
          f"host op, GPU span {gpu[-1].time_range.end - t0:.0f} us, busy {busy:.0f} us, {len(gpu)} GPU ops")
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    prev, gaps = t0, []
    for e in gpu:
        if e.time_range.start - prev > 30:
            gaps.append((round(e.time_range.start - t0), round(e.time_range.start - prev), e.name[:50]))
        prev = max(prev, e.time_range.end)
    print("gaps > 30 us (at, gap, next op):", gaps[:40])


def host_profile(fn: Callable[[], object], rows: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,8000", help="cold prefill lengths, comma-separated")
    ap.add_argument("--out", default=None, help="write here instead of stdout")
    ap.add_argument("--decode-only", action="store_true", help="skip the cold prefills (timings and profiles)")
    ap.add_argument("--sync", action="store_true", help="decode steps without async scheduling (engine.step_chain; on by default here)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    lengths = [int(x) for x in a.lengths.split(",")]
    with open(a.out, "w") if a.out else contextlib.nullcontext(sys.stdout) as sink, \
            contextlib.redirect_stdout(sink), tempfile.TemporaryDirectory() as tmp:
        spec = dict(MODELS["1b"], max_position_embeddings=max(lengths) + 128)
        model_dir = write_tiny_model(Path(tmp) / "1b", TinyModelSpec(**spec))
        top = max(lengths) + 64
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=top // 16 * 2 + 64,
                  max_num_batched_tokens=top, max_model_len=top)
        model, vocab, rng = llm.engine.model, spec["vocab_size"], random.Random(0)
        one = SamplingParams(max_tokens=1, temperature=0.0)

        def cold(n: int) -> Callable[[], object]:
            prompt = [rng.randrange(vocab) for _ in range(n)]
            return lambda: llm.generate(prompt, one)

        def dense(n: int) -> Callable[[], object]:
            ids, pos = torch.randint(0, vocab, (n,), device="cuda"), torch.arange(n, device="cuda")

            def run() -> object:
                with torch.inference_mode():
                    return model.compute_logits(model(ids, pos, DenseCausalAttention(1))[-1:]).argmax().item()
            return run

        def median_ms(make: Callable[[int], Callable[[], object]], n: int, reps: int = 7) -> float:
            times = []
            for i in range(reps + 2):
                fn = make(n)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e3

        if not a.decode_only:
            for n in lengths:
                print(f"n={n}: cold {median_ms(cold, n):.2f} ms, model forward {median_ms(dense, n):.2f} ms")
            timeline(cold(4096), "cold 4096")
            timeline(dense(4096), "model forward 4096")
            host_profile(cold(4096), 25)
        core = llm.engine
        core.chain.enabled = core.chain.eligible and not a.sync
        print(f"async scheduling: {core.chain.enabled}")
        for batch, ctx in ((1, 4096), (1, 128), (32, 128), (32, 1024)):
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            for _ in range(batch):
                core.add_request([rng.randrange(vocab) for _ in range(ctx)], params)
            core.step()
            for _ in range(3):
                core.step()
            # Steps back to back, one sync around them: with async scheduling a step's GPU work
            # overlaps the next call's host work, which a sync per step would hide.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                core.step()
            torch.cuda.synchronize()
            step = (time.perf_counter() - t0) / 20
            print(f"decode batch {batch} ctx {ctx}: step {step * 1e3:.3f} ms (mean of 20), {batch / step:.0f} tok/s")
            timeline(core.step, f"decode step batch {batch} ctx {ctx}")
            host_profile(core.step, 15)
            while core.has_unfinished:
                core.step()


if __name__ == "__main__":
    main()
