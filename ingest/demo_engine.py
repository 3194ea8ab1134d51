"""A demo "vLLM-style engine": publishes KV events as a vLLM engine with CPU offloading would,
on vLLM's wire (ingest.vllm_publisher), for the demo stack's optional kv-ingest source.

    python -m ingest.demo_engine --pub tcp://127.0.0.1:5567 --replay tcp://127.0.0.1:5568

Each step a request of a few chat prefixes (shared system prompt, real vLLM block hashes of
random token ids) fills GPU blocks; blocks also go to the engine's own CPU tier as vLLM's CPU
offloading stores them; past the pool sizes the oldest are evicted. No model runs.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from events.hashing import BlockHasher, to_wire
from events.schema import BlockRemoved, BlockStored, Event, Medium
from ingest.vllm_publisher import VllmStylePublisher


class DemoEngine:
    """The events of a small engine: a GPU pool and its own CPU tier, FIFO eviction."""

    def __init__(self, gpu_blocks: int, cpu_blocks: int, block_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.hasher = BlockHasher(block_size=block_size)
        self.block_size = block_size
        # Resident hashes per tier, oldest first (a dict keeps insertion order).
        self.pools: dict[Medium, tuple[int, dict[int, None]]] = {
            "GPU": (gpu_blocks, {}), "CPU": (cpu_blocks, {})}
        self.system = [self.rng.randrange(32000) for _ in range(2 * block_size)]

    def step(self) -> list[Event]:
        tokens = self.system + [self.rng.randrange(32000)
                                for _ in range(self.block_size * self.rng.randint(1, 4))]
        hashes = [int(to_wire(d)) for d in self.hasher.hash_blocks(tokens)]
        media: tuple[Medium, ...] = ("GPU", "CPU") if self.rng.random() < 0.3 else ("GPU",)
        return [e for medium in media for e in self._store(medium, hashes, tokens)]

    def _store(self, medium: Medium, hashes: Sequence[int], tokens: Sequence[int]) -> list[Event]:
        capacity, resident = self.pools[medium]
        new = [i for i, h in enumerate(hashes) if h not in resident]
        if not new:
            return []
        first = new[0]
        parent = hashes[first - 1] if first > 0 else None
        stored = BlockStored(tuple(hashes[first:]), parent,
                             tuple(tokens[first * self.block_size:len(hashes) * self.block_size]),
                             self.block_size, medium)
        resident.update(dict.fromkeys(hashes[first:]))
        out: list[Event] = [stored]
        evicted: list[int] = []
        while len(resident) > capacity:
            oldest = next(iter(resident))
            del resident[oldest]
            evicted.append(oldest)
        if evicted:
            out.append(BlockRemoved(tuple(evicted), medium))
        return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ingest.demo_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pub", default="tcp://127.0.0.1:5567", help="PUB endpoint to bind")
    p.add_argument("--replay", default="tcp://127.0.0.1:5568", help="replay ROUTER endpoint to bind")
    p.add_argument("--topic", default="", help="topic frame (vLLM's default: empty)")
    p.add_argument("--steps-per-s", type=float, default=5.0, help="batches per second")
    p.add_argument("--gpu-blocks", type=int, default=64)
    p.add_argument("--cpu-blocks", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps_per_s <= 0 or min(args.gpu_blocks, args.cpu_blocks, args.block_size) < 1:
        p.error("--steps-per-s, --gpu-blocks, --cpu-blocks and --block-size must be positive")
    try:
        publisher = VllmStylePublisher(args.pub, args.replay, topic=args.topic)
    except Exception as exc:  # zmq.ZMQError: the address is taken or malformed
        print(f"demo_engine: error: cannot bind {args.pub} / {args.replay}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = DemoEngine(args.gpu_blocks, args.cpu_blocks, args.block_size, args.seed)
    print(f"demo_engine: publishing on {args.pub} (replay {args.replay})", flush=True)
    try:
        while not stop.wait(1.0 / args.steps_per_s):
            events = engine.step()
            if events:
                publisher.publish(events)
    finally:
        publisher.close()
    print(f"demo_engine: stopped after {publisher.next_seq} batches", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
