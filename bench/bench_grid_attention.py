"""The grid attention kernel (engine.grid_kernels) alone, by how each row's keys are split.

A decode attends with one Triton program per (row, KV head, slice of keys) and, when a row is
sliced, a merge kernel. This bench times, in one process, for the 1B shape (32 query heads, 8
KV heads, head dim 64, bf16, block size 16) and decode rows (one query each):

- ``flash split``: ``key_splits``' choice, about two programs per SM in all (flash decoding);
- ``1 slice <= 4 tiles``: one slice for a row of at most 4 tiles of 64 keys (no merge launch),
  else flash split (a rule tried in session 10, measured slower at batch 1);
- ``1 slice``: never sliced.

Each figure: 16 layers' calls captured in one CUDA graph (as the engine runs them), replayed
``--iters`` times, the time per call (median of ``--repeat`` runs).

    python bench/bench_grid_attention.py [--out bench/results/grid_attention_h200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import grid_kernels

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16


def _short_rows_whole(nkeys: int, programs: int, sms: int) -> tuple[int, int]:
    """One slice for a row of at most 4 key tiles, else key_splits."""
    tiles = -(-nkeys // grid_kernels.BLOCK_N)
    return (1, tiles * grid_kernels.BLOCK_N) if tiles <= 4 else grid_kernels.key_splits(nkeys, programs, sms)


def time_case(rows: int, nkeys: int, split: tuple[int, int] | None, iters: int, repeat: int) -> float:
    """Microseconds per grid_attention call, replayed from a graph of LAYERS calls."""
    g = torch.Generator(device="cuda").manual_seed(0)
    nb = nkeys // BS
    blocks = rows * nb + 1
    cache = torch.randn(blocks, LAYERS, 2, BS, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    gather = torch.randperm(blocks - 1, device="cuda", generator=g)[: rows * nb] + 1
    hidden = torch.zeros(rows, 1, 1, nkeys, dtype=torch.bool, device="cuda")
    hidden[..., nkeys - 3 :] = True  # the bucket's last keys are past the token
    q = torch.randn(rows, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)

    def step() -> None:
        for li in range(LAYERS):
            grid_kernels.grid_attention(q, cache, li, gather, hidden, rows, 1, split)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    runs = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / (iters * LAYERS))
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON results (default: print only)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the kernels are Triton)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out: list[dict[str, Any]] = []
    for rows, nkeys in [(1, 256), (1, 1024), (1, 4160), (32, 256), (32, 4160)]:
        programs = rows * HKV
        choices = {"flash split": grid_kernels.key_splits(nkeys, programs, sms),
                   "1 slice <= 4 tiles": _short_rows_whole(nkeys, programs, sms), "1 slice": (1, nkeys)}
        base = time_case(rows, nkeys, choices["flash split"], a.iters, a.repeat)
        for name, split in choices.items():
            us = base if name == "flash split" else time_case(rows, nkeys, split, a.iters, a.repeat)
            rows_out.append({"rows": rows, "keys": nkeys, "choice": name, "slices": split[0], "us_per_call": us,
                             "vs_flash_split": base / us})
            print(f"rows {rows:3d} keys {nkeys:5d} {name:18s} slices {split[0]:3d}: {us:7.2f} us  "
                  f"({base / us:.2f}x flash split)", flush=True)
    if a.out:
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "sms": sms,
                "shape": {"layers": LAYERS, "hq": HQ, "hkv": HKV, "d": D, "block_size": BS, "dtype": "bfloat16"}}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
