"""Throughput of the events core: vLLM codec and CacheState, against plain-msgspec baselines.

    python bench/bench_events_core.py [--blocks 100000] [--before-root DIR]
                                      [--out bench/results/events_core.json]

Each row is timed in the same run as its baseline: the baseline for the codec is msgspec
encoding/decoding the same data pre-built as plain lists and dicts (what any msgpack encoder
must at least do); the baseline for the reducer is inserting the same hashes into a dict.
``--before-root DIR`` adds rows timing the reducer of another checkout (its events/state.py,
say from ``git archive <rev> events | tar -x -C DIR``) on the same records, for before/after
ratios from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from events.codec_vllm import decode_batch, encode_batch
from events.schema import BlockRemoved, BlockStored, Event, LogRecord
from events.state import CacheState


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def load_state_class(root: Path) -> Any:
    """``CacheState`` of ``root/events/state.py``, loaded beside this checkout's.

    The modules it imports from ``events.state*`` come from ``root`` too; they are swapped into
    ``sys.modules`` only while it loads.
    """
    saved = {name: sys.modules.get(name) for name in _STATE_MODULES}
    try:
        for name in _STATE_MODULES:
            path = root / "events" / f"{name.split('.')[-1]}.py"
            if path.exists():
                sys.modules[name] = _load(f"before_{name}", path)
        return _load("before_events.state", root / "events" / "state.py").CacheState
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


_STATE_MODULES = ("events.state_tier", "events.state_apply", "events.state_chains")


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def bridge_records(num_blocks: int) -> list[LogRecord]:
    """The bridge benchmark's payload: 4 BlockStored x 4 blocks of 16 tokens, 4 sources."""
    out = []
    for i in range(num_blocks // 16):
        base = i * 16
        events = tuple(
            BlockStored(tuple(range(base + e * 4, base + e * 4 + 4)), None, tuple(range(64)), 16,
                        "GPU")
            for e in range(4)
        )  # fmt: skip
        out.append(LogRecord(i + 1, f"engine-{i % 4}", 1, i // 4 + 1, 0.0, events))
    return out


def evicting_records(num_blocks: int, resident: int = 10_000) -> list[LogRecord]:
    """A GPU tier in steady state (vLLM's shape): each record stores 50 single-block events
    and removes the 50 oldest blocks, one BlockRemoved each, once ``resident`` are held."""
    out, next_hash = [], 0
    for i in range(num_blocks // 50):
        events: list[Event] = [BlockStored((h,), None, tuple(range(16)), 16, "GPU")
                               for h in range(next_hash, next_hash + 50)]
        events += [BlockRemoved((h,), "GPU") for h in range(next_hash - resident, next_hash - resident + 50)
                   if h >= 0]
        next_hash += 50
        out.append(LogRecord(i + 1, "e1", 1, i + 1, 0.0, tuple(events)))
    return out


def tracking(cls: Any) -> Any:
    """``cls`` whose instances record their changes for a checkpoint writer (DECISIONS 68)."""

    def new() -> Any:
        state = cls()
        state.track_changes()
        return state

    return new


def run(num_blocks: int, before: Any = None) -> list[dict[str, object]]:
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

    batches = bridge_records(num_blocks)
    evicting = evicting_records(num_blocks)

    def applier(cls: Any, recs: list[LogRecord]) -> Callable[[], None]:
        def apply_all() -> None:
            state = cls()
            for r in recs:
                state.apply(r)

        return apply_all

    def dict_baseline(recs: list[LogRecord]) -> Callable[[], None]:
        def insert_all() -> None:
            d: dict[int, object] = {}
            for r in recs:
                for e in r.events:
                    if isinstance(e, BlockRemoved):
                        for h in e.block_hashes:
                            d.pop(h, None)
                        continue
                    assert isinstance(e, BlockStored)
                    for h in e.block_hashes:
                        d[h] = e

        return insert_all

    rows = [
        ("encode_batch, 1-block events", lambda: encode_batch(single, 1.0),
         lambda: msgspec.msgpack.encode([1.0, plain, 0])),
        ("decode_batch, 1-block events", lambda: decode_batch(payload),
         lambda: msgspec.msgpack.decode(plain_payload)),
        ("CacheState.apply, 100-block events", applier(CacheState, records),
         dict_baseline(records)),
        ("CacheState.apply, 4x4-block batches", applier(CacheState, batches),
         dict_baseline(batches)),
        ("CacheState.apply, evicting 1-block events", applier(CacheState, evicting),
         dict_baseline(evicting)),
        ("CacheState.apply, evicting, changes tracked", applier(tracking(CacheState), evicting),
         dict_baseline(evicting)),
    ]  # fmt: skip
    if before is not None:
        rows += [
            ("before: apply, 100-block events", applier(before, records), dict_baseline(records)),
            ("before: apply, 4x4-block batches", applier(before, batches), dict_baseline(batches)),
            ("before: apply, evicting 1-block events", applier(before, evicting),
             dict_baseline(evicting)),
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
    parser.add_argument("--before-root", type=Path, default=None,
                        help="a checkout of the code before a change: its reducer runs too")
    parser.add_argument("--out", type=Path, default=Path("bench/results/events_core.json"))
    args = parser.parse_args()
    before = None if args.before_root is None else load_state_class(args.before_root)
    rows = run(args.blocks, before)
    print(f"{'what':38} {'ours ms':>9} {'base ms':>9} {'blocks/s':>12} {'x base':>7}")
    for r in rows:
        print(
            f"{r['what']:38} {float(r['ours_s']) * 1e3:9.1f} {float(r['baseline_s']) * 1e3:9.1f}"  # type: ignore[arg-type]
            f" {float(r['blocks_per_s']):12,.0f} {float(r['ratio_vs_baseline']):7.2f}"  # type: ignore[arg-type]
        )
    by_name = {r["what"]: float(r["ours_s"]) for r in rows}  # type: ignore[arg-type]
    for what in ("100-block events", "4x4-block batches", "evicting 1-block events"):
        if f"before: apply, {what}" in by_name:
            speedup = by_name[f"before: apply, {what}"] / by_name[f"CacheState.apply, {what}"]
            print(f"CacheState.apply speed-up, {what}: {speedup:.2f}x (same run)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
