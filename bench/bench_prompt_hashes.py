"""Block hashes of one prompt, as the router and the engine compute them: best of N, in us.

    python bench/bench_prompt_hashes.py [--ids 4096] [--repeat 200] [--out FILE]
    python bench/ab_trees.py --before /tmp/old --after . --rounds 3 --out bench/results/x.json \\
        -- bench/bench_prompt_hashes.py     # the same script copied into the old tree first

Per vocabulary (32,000: every id below 2**16; 128,256: Llama 3's, a third of the ids above):
``router``, ``Router.hashes`` of a list of ids (the wire hashes of every full block but the
last token's); ``engine``, ``BlockHasher.hash_blocks`` of the checked int64 array a cold
prompt is hashed from (the digest memo's misses). Best of ``--repeat`` calls: the machine is
shared and a call's own time is what is compared.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCABS = (32000, 128256)


def _best_us(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=4096, help="prompt length in ids (default 4096)")
    ap.add_argument("--repeat", type=int, default=200, help="calls per figure, the best kept (default 200)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "prompt_hashes.json"))
    a = ap.parse_args()
    if a.ids < 32 or a.repeat < 1:
        ap.error("--ids must be >= 32 and --repeat >= 1")
    from router.config import EngineSpec, RouterConfig
    from router.service import Router

    router = Router(RouterConfig(engines=(EngineSpec("e0", "http://127.0.0.1:9"),)), None, None)  # type: ignore[arg-type]
    rows = []
    try:
        for vocab in VOCABS:
            rng = random.Random(vocab)
            ids = [rng.randrange(vocab) for _ in range(a.ids + 1)]
            array = np.array(ids[: a.ids], dtype=np.int64)
            rows.append({"vocab": vocab, "ids": a.ids,
                         "router_us": _best_us(functools.partial(router.hashes, ids), a.repeat),
                         "engine_us": _best_us(functools.partial(router.hasher.hash_blocks, array), a.repeat)})
            print(f"vocabulary {vocab}: router {rows[-1]['router_us']:.1f} us, engine {rows[-1]['engine_us']:.1f} us")
    finally:
        router.close()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load_1m": os.getloadavg()[0], "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
