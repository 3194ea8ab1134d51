"""The host work of a GPU prefix hit (issue 22): wall time per engine stage, on any machine.

    python bench/bench_hit_host.py [--prompt-len 4096,8000] [--iters 30] [--out FILE]
    python bench/bench_hit_host.py --device cuda --model 1b --model-dir /tmp/m1b   # a real GPU hit
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

``--device cuda --model 1b`` (bench_offload's 1B shape, bfloat16) runs the real step on the GPU:
``generate`` is then a GPU hit's TTFT without the offload connector (steps synchronous, as with
one), and the stages inside the step show which host work is serial with the GPU (everything
before the graph's replay and after the token is read). ``--idle-ms`` sleeps before each
measured hit, as a benchmark that waits for the store before it does. ``--model-dir`` keeps the
written checkpoint for the next run (ab_trees runs the script once per tree and round).
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
          ("kv", "register_full_blocks"), ("kv", "free"), ("", "_launch"), ("", "_outputs"), ("", "_free_ending"),
          ("runner.graphs", "run"), ("runner.graphs", "_values"), ("chain", "pick"), ("chain", "tokens")]
# (module, class, method): stages of objects made inside a step (timed on their class).
CLASS_STAGES = [("engine.grid_buffers", "GridInputs", "upload"), ("engine.grid_buffers", "GridInputs", "launched"),
                # the trees before engine.grid_buffers
                ("engine.step_graphs", "_Inputs", "upload"), ("engine.step_graphs", "_Inputs", "launched")]


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
        setattr(obj, name, _timed(fn, name, spent))
        done.append((obj, name))
    return done


def _timed(fn: Callable[..., Any], name: str, spent: dict[str, float]) -> Callable[..., Any]:
    """``fn`` adding its wall time to ``spent[name]``."""
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    return run


def _wrap_classes(spent: dict[str, float]) -> list[tuple[Any, str, Any]]:
    """Timing wrappers on the classes of ``CLASS_STAGES`` (those a tree has); returns what to undo."""
    import importlib

    done = []
    for module, cls_name, name in CLASS_STAGES:
        cls = getattr(importlib.import_module(module), cls_name, None)
        fn = getattr(cls, name, None) if cls is not None else None
        if fn is None:
            continue
        setattr(cls, name, _timed(fn, name, spent))
        done.append((cls, name, fn))
    return done


def measure(model_dir: Path, prompt_len: int, iters: int, with_model: bool, device: str = "cpu",
            idle_s: float = 0.0) -> dict[str, Any]:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    cuda = device.startswith("cuda")
    extra: dict[str, Any] = dict(async_scheduling=False) if cuda else {}
    llm = LLM(str(model_dir), device=device, dtype="bfloat16" if cuda else "float32",
              num_gpu_blocks=prompt_len // 16 * 2 + 16, max_num_batched_tokens=prompt_len + 64,
              max_model_len=prompt_len + 64, **extra)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    if not with_model:
        def no_model(out: Any, sample_rows: list[int], *args: Any, **kwargs: Any) -> torch.Tensor:
            return torch.zeros(len(sample_rows), VOCAB)

        setattr(llm.engine.runner, "execute", no_model)  # noqa: B010 (an instance attribute, undone below)
    rng = random.Random(prompt_len)
    spent: dict[str, float] = {}
    rows: dict[str, list[float]] = {}
    undo = _wrap(llm.engine, spent)
    undo_classes = _wrap_classes(spent)
    warmup = 5
    try:
        for it in range(iters + warmup):
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
            llm.generate(prompt, params)
            if idle_s:
                time.sleep(idle_s)
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
        for cls, name, fn in undo_classes:
            setattr(cls, name, fn)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"prompt_len": prompt_len, "iters": iters, "with_model": with_model, "device": device,
            "idle_ms": idle_s * 1e3, "cached_tokens": (prompt_len - 1) // 16 * 16,
            "stages_ms": dict(sorted(med.items(), key=lambda kv: -kv[1])),
            "best_ms": {k: min(rows[k]) for k in med}, "q1_ms": {k: statistics.quantiles(v, n=4)[0] for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", default="4096,8000", help="comma-separated prompt lengths (default 4096,8000)")
    ap.add_argument("--iters", type=int, default=30, help="measured hits per length, after 5 warm-up (default 30)")
    ap.add_argument("--with-model", action="store_true", help="run the model's step (on this CPU it slows the rest)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: cuda runs the real step (--model 1b)")
    ap.add_argument("--model", choices=["tiny", "1b"], default="tiny",
                    help="tiny (default: 1 layer, width 64) or 1b (bench_offload's 1B shape, bfloat16; CUDA only)")
    ap.add_argument("--model-dir", default=None, help="write the checkpoint here and reuse it when it is there")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="sleep this long before each measured hit (default 0)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "hit_host.json"))
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.prompt_len.split(",")]
    except ValueError:
        ap.error(f"--prompt-len: expected integers separated by commas, got {a.prompt_len!r}")
    if a.iters < 1 or any(n < 32 for n in lengths) or a.idle_ms < 0:
        ap.error("--iters must be >= 1, every --prompt-len >= 32 and --idle-ms >= 0")
    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device here")
    if a.model == "1b" and not cuda:
        ap.error("--model 1b needs --device cuda (bfloat16)")
    from engine.model.checkpoint import TinyModelSpec, write_tiny_model

    if a.model == "1b":
        from bench.bench_offload import MODELS

        spec = TinyModelSpec(**MODELS["1b"])
        if max(lengths) + 64 > spec.max_position_embeddings:
            ap.error(f"--prompt-len: at most {spec.max_position_embeddings - 64} tokens with --model 1b")
    else:
        spec = TinyModelSpec(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, max_position_embeddings=max(lengths) + 64)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="hit-host-") as tmp:
        model_dir = Path(a.model_dir) if a.model_dir else Path(tmp) / "model"
        if not (model_dir / "config.json").is_file():
            print(f"writing the {a.model} checkpoint to {model_dir}", file=sys.stderr, flush=True)
            write_tiny_model(model_dir, spec)
        for n in lengths:
            r = measure(model_dir, n, a.iters, a.with_model or cuda, a.device, a.idle_ms / 1e3)
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
