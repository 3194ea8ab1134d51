"""The host work of a GPU prefix hit (issue 22): wall time per engine stage, on any machine.

    python bench/bench_hit_host.py [--prompt-len 4096,8000] [--iters 30] [--out FILE]
    python bench/ab_trees.py --before /tmp/old --after . --rounds 3 --out bench/results/x.json \\
        -- bench/bench_hit_host.py          # the same script copied into the old tree first

Per iteration a new prompt of random ids (vocabulary 32,000: most ids take 3 CBOR bytes, as
real ones do) is computed cold, then generated again with one output token: a GPU-pool hit of
all its full blocks but the last (the prompt's last token is always computed). Only the hit
is measured, by timing wrappers set on the engine's instances (bench_offload's way; no
profiler). Reported per prompt length in ms, medians (``stages_ms``; also the lower quartile
``q1_ms`` and the best ``best_ms``, steadier on a shared machine): ``generate`` (what the caller waits
for), ``execute`` (the model's step), ``host`` (``generate`` minus ``execute``: the work this
bench is about) and every stage; a stage that a tree does not have is left out.

The model's step is replaced by one that returns zero logits (``--with-model`` keeps it): on a
GPU the step does not run on the host's cores, and on this CPU every stage after a real step
ran 5-10x slower (its caches taken by the forward), which measured the forward, not the host
work. The tokens then differ from a real run's; nothing this bench times depends on them.
With ``--with-model`` the model is tiny (1 layer, width 64) and torch runs one thread: with
two, OpenMP's spinning threads made the tiny step ~10x slower on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = 32000

# (attribute path from the engine, method): the stages timed; nested ones count inside their parents.
STAGES = [("", "prepare_prompt"), ("", "add_prepared"), ("", "step"), ("", "_append_token"), ("", "_settle"),
          ("", "_flush_events"), ("runner", "execute"), ("scheduler", "schedule"), ("scheduler", "finish"),
          ("scheduler.holds", "hold"), ("kv", "find_prefix_hit"), ("kv", "allocate_for_admission"),
          ("kv", "register_full_blocks"), ("kv", "free")]


def _wrap(engine: Any, spent: dict[str, float]) -> list[tuple[Any, str]]:
    """Timing wrappers on the engine's instances; returns what to undo."""
    done = []
    for path, name in STAGES:
        obj = engine
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        fn = getattr(obj, name, None) if obj is not None else None
        if fn is None:
            continue

        def run(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t0

        setattr(obj, name, run)
        done.append((obj, name))
    return done


def measure(model_dir: Path, prompt_len: int, iters: int, with_model: bool) -> dict[str, Any]:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_gpu_blocks=prompt_len // 16 * 2 + 16,
              max_num_batched_tokens=prompt_len + 64, max_model_len=prompt_len + 64)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    if not with_model:
        def no_model(out: Any, sample_rows: list[int], *args: Any) -> torch.Tensor:
            return torch.zeros(len(sample_rows), VOCAB)

        setattr(llm.engine.runner, "execute", no_model)  # noqa: B010 (an instance attribute, undone below)
    rng = random.Random(prompt_len)
    spent: dict[str, float] = {}
    rows: dict[str, list[float]] = {}
    undo = _wrap(llm.engine, spent)
    warmup = 5
    try:
        for it in range(iters + warmup):
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
            llm.generate(prompt, params)
            spent.clear()
            t0 = time.perf_counter()
            out = llm.generate(prompt, params)
            spent["generate"] = time.perf_counter() - t0
            assert out[0].num_cached_tokens == (prompt_len - 1) // 16 * 16, "not a prefix hit"
            assert llm.reset_prefix_cache()
            if it >= warmup:
                spent["host"] = spent["generate"] - spent.get("execute", 0.0)
                for k, v in spent.items():
                    rows.setdefault(k, []).append(v * 1e3)
            if (it + 1) % 10 == 0:
                print(f"  {prompt_len} tokens: {it + 1}/{iters + warmup}", file=sys.stderr, flush=True)
    finally:
        for obj, name in undo:
            delattr(obj, name)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"prompt_len": prompt_len, "iters": iters, "with_model": with_model, "cached_tokens": (prompt_len - 1) // 16 * 16,
            "stages_ms": dict(sorted(med.items(), key=lambda kv: -kv[1])),
            "best_ms": {k: min(rows[k]) for k in med}, "q1_ms": {k: statistics.quantiles(v, n=4)[0] for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", default="4096,8000", help="comma-separated prompt lengths (default 4096,8000)")
    ap.add_argument("--iters", type=int, default=30, help="measured hits per length, after 5 warm-up (default 30)")
    ap.add_argument("--with-model", action="store_true", help="run the model's step (on this CPU it slows the rest)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "hit_host.json"))
    a = ap.parse_args()
    lengths = [int(x) for x in a.prompt_len.split(",")]
    if a.iters < 1 or any(n < 32 for n in lengths):
        ap.error("--iters must be >= 1 and every --prompt-len >= 32")
    from engine.model.checkpoint import TinyModelSpec, write_tiny_model

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="hit-host-") as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", TinyModelSpec(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
            max_position_embeddings=max(lengths) + 64))
        for n in lengths:
            r = measure(model_dir, n, a.iters, a.with_model)
            s = r["stages_ms"]
            print(f"{n} tokens: generate {s['generate']:.3f} ms, host {s['host']:.3f} ms (q1 {r['q1_ms']['host']:.3f}); "
                  + ", ".join(f"{k} {v:.3f}" for k, v in s.items() if k not in ("generate", "host")))
            results.append(r)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                               "torch": torch.__version__, "load_1m": os.getloadavg()[0], "hits": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
