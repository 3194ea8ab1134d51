"""What one checkpoint writes and costs its export, whole state (format 1) against incremental
(format 2, DECISIONS 60), on the state of bench_recovery's checkpoint-cost runs.

    python bench/bench_checkpoint_size.py [--cpu-blocks 100000] [--step 100000] [--steps 10]
                                          [--out bench/results/checkpoint_size.json]

The state: ``--cpu-blocks`` CPU-tier blocks, then GPU stores as shape c sends them (single-hash
``BlockStored`` of 16 tokens) ``--step`` at a time (50k block ev/s for a 2 s checkpoint interval
is 100k), with vLLM-like content (random 64-bit hashes, random token ids below 128k: shape c's
own sequential hashes and equal tokens compress far better), and 1% of the resident GPU blocks
removed each step: the oldest (``--removals oldest``, an LRU cache in steady state) or at
random (``random``, the worst case for chunks cut in insertion order). After each step, one checkpoint each way, in this process (the
export a forked child does, without the fork): format 1 exports the whole state and encodes every
chunk; format 2 cuts it (events.checkpoint_cut) with the previous checkpoint's fingerprints and
the addresses already stored. Reported per checkpoint: the bytes each would send to Redis and
the CPU seconds of the export (``time.process_time``). Bytes do not depend on the machine's
load; CPU seconds less than wall time does, but both ways are measured back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.checkpoint import encode_chunk, split
from events.checkpoint_cut import Cuts, pieces
from events.schema import BlockRemoved, BlockStored, Event, LogRecord
from events.state import CacheState

BLOCK_SIZE = 16


class Run:
    def __init__(self) -> None:
        self.state = CacheState()
        self.seq: dict[str, int] = {}
        self.known: dict[bytes, tuple[str, int]] = {}
        self.present: set[str] = set()

    def put(self, source: str, events: tuple[Event, ...]) -> None:
        seq = self.seq[source] = self.seq.get(source, 0) + 1
        self.state.apply(LogRecord(self.state.offset + 1, source, 1, seq, 0.0, events))

    def whole(self) -> tuple[int, float]:
        t = time.process_time()
        size = sum(len(encode_chunk(part)[0]) for part in split(self.state.export()))
        return size, time.process_time() - t

    def incremental(self) -> tuple[int, int, int, float]:
        t = time.process_time()
        got = list(pieces(self.state.tiers(), Cuts(), self.known, self.present))
        cpu = time.process_time() - t
        sent = sum(p.length for p in got if p.data is not None)
        self.known = {p.fingerprint: (p.address, p.length) for p in got}
        self.present = {p.address for p in got}  # the kept checkpoints' chunks (the newest's here)
        return sent, sum(p.length for p in got), sum(p.data is not None for p in got), cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-blocks", type=int, default=100_000)
    p.add_argument("--step", type=int, default=100_000, help="GPU blocks stored between checkpoints")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--removals", choices=("oldest", "random"), default="oldest")
    p.add_argument("--out", default="bench/results/checkpoint_size.json")
    args = p.parse_args()
    rng = random.Random(0)
    run = Run()
    vocab = range(128_000)

    def block(medium: str) -> BlockStored:
        return BlockStored((rng.getrandbits(64),), None, tuple(rng.choices(vocab, k=BLOCK_SIZE)),
                           BLOCK_SIZE, medium)  # type: ignore[arg-type]

    for at in range(0, args.cpu_blocks, 100):
        run.put("offloadd-cpu", tuple(block("CPU") for _ in range(min(100, args.cpu_blocks - at))))
    rows = []
    for step in range(args.steps + 1):
        if step:
            for _ in range(0, args.step, 100):
                run.put("engine-0", tuple(block("GPU") for _ in range(100)))
            resident = list(run.state.resident("engine-0", "GPU"))
            k = len(resident) // 100
            gone = resident[:k] if args.removals == "oldest" else rng.sample(resident, k)
            for at in range(0, len(gone), 100):
                run.put("engine-0", (BlockRemoved(tuple(gone[at : at + 100]), "GPU"),))
        whole, whole_cpu = run.whole()
        sent, size, new, cpu = run.incremental()
        blocks = sum(run.state.counts().values())
        rows.append({"blocks": blocks, "whole_bytes": whole, "whole_cpu_s": round(whole_cpu, 3),
                     "incremental_bytes_sent": sent, "incremental_size": size, "new_chunks": new,
                     "incremental_cpu_s": round(cpu, 3)})
        print(f"{blocks:>9} blocks: whole {whole / 2**20:7.1f} MiB {whole_cpu:5.2f} s CPU | incremental "
              f"sent {sent / 2**20:6.2f} MiB ({new} chunks) of {size / 2**20:6.1f} MiB, {cpu:5.2f} s CPU",
              flush=True)
    later = rows[1:]
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_1m": os.getloadavg()[0]},
              "args": vars(args), "rows": rows,
              "after_first": {"whole_bytes": sum(r["whole_bytes"] for r in later),
                              "incremental_bytes_sent": sum(r["incremental_bytes_sent"] for r in later),
                              "whole_cpu_s": round(sum(r["whole_cpu_s"] for r in later), 2),
                              "incremental_cpu_s": round(sum(r["incremental_cpu_s"] for r in later), 2)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
