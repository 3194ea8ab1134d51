"""Throughput of the events core: vLLM codec and CacheState, against plain-msgspec baselines.

    python bench/bench_events_core.py [--blocks 100000] [--out bench/results/events_core.json]

Each row is timed in the same run as its baseline: the baseline for the codec is msgspec
encoding/decoding the same data pre-built as plain lists and dicts (what any msgpack encoder
must at least do); the baseline for the reducer is inserting the same hashes into a dict.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from events.codec_vllm import decode_batch, encode_batch
from events.schema import BlockStored, LogRecord
from events.state import CacheState


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(num_blocks: int) -> list[dict[str, object]]:
    bs = 16
    single = [
        BlockStored((i,), i - 1 if i else None, tuple(range(bs)), bs, "GPU")
        for i in range(num_blocks)
    ]
    plain = [
        {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": i - 1 if i else None,
         "token_ids": list(range(bs)), "block_size": bs, "lora_id": None, "medium": "GPU",
         "lora_name": None}
        for i in range(num_blocks)
    ]  # fmt: skip
    payload = encode_batch(single, 1.0)
    plain_payload = msgspec.msgpack.encode([1.0, plain, 0])
    records = [
        LogRecord(i + 1, "e1", 1, i + 1, 0.0, (BlockStored(
            tuple(range(i * 100, i * 100 + 100)), i * 100 - 1 if i else None,
            tuple(range(100 * bs)), bs, "GPU"),))
        for i in range(num_blocks // 100)
    ]  # fmt: skip

    def apply_all() -> None:
        state = CacheState()
        for r in records:
            state.apply(r)

    def dict_baseline() -> None:
        d: dict[int, object] = {}
        for r in records:
            for e in r.events:
                assert isinstance(e, BlockStored)
                for h in e.block_hashes:
                    d[h] = e

    rows = [
        ("encode_batch, 1-block events", lambda: encode_batch(single, 1.0),
         lambda: msgspec.msgpack.encode([1.0, plain, 0])),
        ("decode_batch, 1-block events", lambda: decode_batch(payload),
         lambda: msgspec.msgpack.decode(plain_payload)),
        ("CacheState.apply, 100-block events", apply_all, dict_baseline),
    ]  # fmt: skip
    out: list[dict[str, object]] = []
    for name, ours, base in rows:
        t_ours, t_base = best_of(ours), best_of(base)
        out.append(
            {
                "what": name,
                "blocks": num_blocks,
                "ours_s": t_ours,
                "baseline_s": t_base,
                "blocks_per_s": num_blocks / t_ours,
                "ratio_vs_baseline": t_ours / t_base,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/events_core.json"))
    args = parser.parse_args()
    rows = run(args.blocks)
    print(f"{'what':38} {'ours ms':>9} {'base ms':>9} {'blocks/s':>12} {'x base':>7}")
    for r in rows:
        print(
            f"{r['what']:38} {float(r['ours_s']) * 1e3:9.1f} {float(r['baseline_s']) * 1e3:9.1f}"  # type: ignore[arg-type]
            f" {float(r['blocks_per_s']):12,.0f} {float(r['ratio_vs_baseline']):7.2f}"  # type: ignore[arg-type]
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
