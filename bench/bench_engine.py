"""Engine throughput: prefill and decode tokens/s, next to a dense forward of the same weights.

On CUDA (default there): a 1B-shaped random model (16 layers, hidden 2048, 32 heads, 8 KV heads,
vocab 128256, bf16). On CPU: the tiny test models (plain and hybrid), float32. The dense
reference runs the same weights with ``is_causal`` SDPA and no KV cache (no window either: for
the hybrid model it is a throughput yardstick, not the same function), in the same process,
interleaved with the engine runs. Target on the H200: engine prefill >= 0.8 x dense. Prefix
caching is off so that every prefill is computed. Decodes (batch 1 and the shape's batch, 128-token
prompts) run with async scheduling (engine.step_chain) and without it ("sync"), alternating in the
same process where the engine has it (CUDA graphs); ``vs_sync`` is the speed-up over the sync run.

    python bench/bench_engine.py [--shape tiny|1b] [--device cuda] [--out bench/results/engine.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.llm import LLM
from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from engine.model.llama import DenseCausalAttention
from engine.sampling import SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"spec": TinyModelSpec(), "prefill_len": 512, "prefill_batch": 4, "decode_batch": 8,
             "decode_tokens": 32, "dtype": "float32"},
    "tiny-hybrid": {"spec": TinyModelSpec(hybrid=True), "prefill_len": 512, "prefill_batch": 4,
                    "decode_batch": 8, "decode_tokens": 32, "dtype": "float32"},
    "1b": {
        "spec": TinyModelSpec(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                              num_heads=32, num_kv_heads=8, max_position_embeddings=8192,
                              tie_word_embeddings=True, init_std=0.02, save_dtype="bfloat16",
                              rope_theta=500000.0),
        "prefill_len": 4096, "prefill_batch": 4, "decode_batch": 32, "decode_tokens": 64, "dtype": "bfloat16",
    },
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(fn: Callable[[], None], device: str, repeat: int) -> float:
    """Median seconds of ``repeat`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_shape(name: str, device: str, repeat: int) -> list[dict[str, Any]]:
    cfg = SHAPES[name]
    spec: TinyModelSpec = cfg["spec"]
    n, batch = cfg["prefill_len"], cfg["prefill_batch"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_model(tmp, spec)
        blocks = (max(n * batch, cfg["decode_batch"] * (128 + cfg["decode_tokens"])) // 16) * 2
        llm = LLM(tmp, device=device, dtype=cfg["dtype"], num_gpu_blocks=blocks,
                  max_num_batched_tokens=n * batch, max_num_seqs=max(batch, cfg["decode_batch"]),
                  max_model_len=spec.max_position_embeddings, enable_prefix_caching=False)
        model = llm.engine.model
        gen = torch.Generator().manual_seed(0)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        for b in (1, batch):
            prompts = [torch.randint(0, min(spec.vocab_size, 256), (n,), generator=gen).tolist() for _ in range(b)]
            ids = torch.tensor(prompts, device=device)
            pos = torch.arange(n, device=device).repeat(b)

            def engine_prefill(prompts: list[list[int]] = prompts) -> None:
                llm.generate(prompts, one)

            def dense_prefill(ids: torch.Tensor = ids, pos: torch.Tensor = pos, b: int = b) -> None:
                with torch.inference_mode():
                    hidden = model(ids.flatten(), pos, DenseCausalAttention(b))
                    model.compute_logits(hidden.view(b, n, -1)[:, -1]).float().cpu()

            t_dense = _best(dense_prefill, device, repeat)
            t_engine = _best(engine_prefill, device, repeat)
            t_dense = min(t_dense, _best(dense_prefill, device, repeat))
            rows.append({"model": name, "phase": f"prefill {b}x{n}", "engine_tok_s": b * n / t_engine,
                         "dense_tok_s": b * n / t_dense, "ratio": t_dense / t_engine})

        dt = cfg["decode_tokens"]
        chain = llm.engine.chain
        modes = [True, False] if chain.eligible else [False]
        for db in (1, cfg["decode_batch"]):
            prompts = [torch.randint(0, min(spec.vocab_size, 256), (128,), generator=gen).tolist() for _ in range(db)]

            def decode(prompts: list[list[int]] = prompts) -> float:
                core = llm.engine
                params = SamplingParams(temperature=0.0, max_tokens=dt + 1, ignore_eos=True)
                for p in prompts:
                    core.add_request(p, params)
                core.step()  # prefill + first token
                _sync(device)
                t0 = time.perf_counter()
                while core.has_unfinished:
                    core.step()
                _sync(device)
                return time.perf_counter() - t0

            # Async scheduling (engine.step_chain) on and off, alternating, in the same process.
            times: dict[bool, list[float]] = {m: [] for m in modes}
            for m in modes:
                chain.enabled = m
                decode()
            for _ in range(repeat):
                for m in modes:
                    chain.enabled = m
                    times[m].append(decode())
            chain.enabled = modes[0]
            sync = statistics.median(times[False])
            for m in modes:
                t_dec = statistics.median(times[m])
                rows.append({"model": name, "phase": f"decode batch {db}" + ("" if m else " sync"),
                             "engine_tok_s": len(prompts) * dt / t_dec, "step_ms": t_dec / dt * 1e3,
                             "dense_tok_s": None, "ratio": None, "vs_sync": sync / t_dec,
                             "async_scheduling": m})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default by device")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON results file (default bench/results/engine-<device>.json)")
    a = ap.parse_args()
    shapes = a.shape or (["1b"] if a.device.startswith("cuda") else ["tiny", "tiny-hybrid"])
    if a.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [r for s in shapes for r in bench_shape(s, a.device, a.repeat)]
    dev_name = torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"device: {a.device} ({dev_name}), torch {torch.__version__}")
    print(f"{'model':<12} {'phase':<22} {'engine tok/s':>14} {'dense tok/s':>14} {'engine/dense':>13} {'step ms':>8}")
    for r in rows:
        dense = f"{r['dense_tok_s']:14.0f}" if r["dense_tok_s"] else f"{'-':>14}"
        ratio = f"{r['ratio']:13.2f}" if r["ratio"] else f"{'-':>13}"
        step = f"{r['step_ms']:8.3f}" if r.get("step_ms") else f"{'-':>8}"
        print(f"{r['model']:<12} {r['phase']:<22} {r['engine_tok_s']:14.0f} {dense} {ratio} {step}")
    out = Path(a.out or Path(__file__).parent / "results" / f"engine-{a.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": a.device, "device_name": dev_name, "torch": torch.__version__,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
