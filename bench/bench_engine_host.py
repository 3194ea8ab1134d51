"""The engine's host work per request that issue 22 named, before and after, on any machine.

No model runs: these are the pieces of host time that sit serial with the GPU on a step.

- ``hash``: the block digests of a 4,096-token prompt (256 blocks, sha256_cbor), as a prefix
  hit's admission needs them: hashed (before) vs looked up in engine.digest_memo (after; the
  first sight of a prompt, ``memo cold``, hashes and remembers).
- ``text``: one decode's output text for a request with N output tokens (byte tokenizer):
  decoding all N again (before) vs engine.output_text's incremental decoder (after).
- ``decode ids``: a decode's input token at a 4,096-token context: slicing prompt + outputs
  joined (before) vs the outputs alone (after).

Each figure is the best of ``--repeat`` medians (the CI machine is shared and noisy).

    python bench/bench_engine_host.py [--repeat 5] [--out bench/results/engine_host.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.digest_memo import DigestMemo
from engine.output_text import OutputText
from events.hashing import BlockHasher
from events.tokenizer import ByteTokenizer


def _us(fn: Callable[[], object], repeat: int, inner: int = 20) -> float:
    """Best of ``repeat`` medians of ``inner`` calls, in microseconds."""
    medians = []
    for _ in range(repeat):
        times = []
        for _ in range(inner):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_host.json"))
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []

    hasher = BlockHasher("bench", 16, "sha256_cbor")
    prompt = rng.integers(0, 128256, 4096).astype(np.int64)
    memo = DigestMemo(hasher, 8192)
    memo.hash_blocks(prompt)
    before = _us(lambda: hasher.hash_blocks(prompt), a.repeat)
    after = _us(lambda: memo.hash_blocks(prompt), a.repeat)
    cold = _us(lambda: DigestMemo(hasher, 8192).hash_blocks(prompt), a.repeat)
    rows.append({"what": "hash 4096-token prompt", "before_us": before, "after_us": after, "memo_cold_us": cold})

    tok = ByteTokenizer()
    for n in (64, 512, 2048):
        ids = rng.integers(32, 127, n).tolist()
        text = OutputText(tok)
        for i, t in enumerate(ids[:-1]):
            text.append(t, ids[: i + 1])
        state = text._decoder.getstate(), text._done

        def incremental(text: OutputText = text, ids: list[int] = ids, state: Any = state) -> None:
            text._decoder.setstate(state[0])
            text._done = state[1]
            text.append(ids[-1], ids)

        rows.append({"what": f"text of a decode, {n} outputs", "before_us": _us(lambda ids=ids: tok.decode(ids), a.repeat),
                     "after_us": _us(incremental, a.repeat)})

    prompt_ids = prompt.tolist()
    outputs = rng.integers(0, 128256, 64).tolist()
    start = len(prompt_ids) + len(outputs) - 1
    rows.append({"what": "decode token ids, 4096 context",
                 "before_us": _us(lambda: (prompt_ids + outputs)[start : start + 1], a.repeat),
                 "after_us": _us(lambda: outputs[start - 4096 : start - 4095], a.repeat)})

    for r in rows:
        r["speedup"] = r["before_us"] / r["after_us"]
        extra = f", memo cold {r['memo_cold_us']:.1f} us" if "memo_cold_us" in r else ""
        print(f"{r['what']:<32} before {r['before_us']:8.1f} us  after {r['after_us']:8.1f} us  "
              f"x{r['speedup']:.1f}{extra}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
