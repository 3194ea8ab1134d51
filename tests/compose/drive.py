"""Real traffic for the compose stack, run inside its network namespace (tests/compose nsenters
it there) from this checkout's venv: Generate requests with shared prefixes to the engine, with
the GPU tier small enough (KV_GPU_BLOCKS) that the prefix is evicted from it and comes back from
offloadd's CPU tier; a subscriber on kv-bridge rebuilds the state from snapshot and stream.
Prints one JSON object for the test to check.

    python -m tests.compose.drive --engine 127.0.0.1:50061 --pub tcp://127.0.0.1:5557 \
        --replay tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

import grpc
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from events.hashing import DEFAULT_SEED, BlockHasher
from events.subscriber import KvEventSubscriber

BLOCK = 16
VOCAB = 512  # the tiny model's (TinyModelSpec), written by model-init


def _generate(stub: generate_pb2_grpc.GenerateStub, ids: list[int]) -> dict[str, int]:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids),
        sampling=generate_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    last = None
    for msg in stub.Generate(request, timeout=120):
        last = msg
    assert last is not None and last.finished, "the stream ended without a finished message"
    return {"prompt": last.num_prompt_tokens, "gpu": last.num_gpu_cached_tokens,
            "cpu": last.num_cpu_cached_tokens}


def drive(engine: str, pub: str, replay: str, num_gpu_blocks: int) -> dict[str, Any]:
    rng = random.Random(23)
    tokens = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    prefix = tokens(6 * BLOCK)
    a, b = prefix + tokens(2 * BLOCK), prefix + tokens(2 * BLOCK)
    # enough new blocks to push every block of a and b out of the GPU tier
    evictors = [tokens(8 * BLOCK) for _ in range(num_gpu_blocks // 8 + 2)]
    out: dict[str, Any] = {}
    with grpc.insecure_channel(engine) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        out["a"] = _generate(stub, a)
        out["b"] = _generate(stub, b)
        out["evictors"] = [_generate(stub, e) for e in evictors]
        out["a_again"] = _generate(stub, a)
    hasher = BlockHasher(DEFAULT_SEED, BLOCK)  # compose.yaml sets no PYTHONHASHSEED
    with KvEventSubscriber(pub, replay) as sub:
        sub.bootstrap()

        def cpu_prefix(s: KvEventSubscriber) -> int:
            return max((m.num_cpu for m in s.longest_prefix(a, hasher).values()), default=0)

        sub.run_until(lambda s: cpu_prefix(s) >= 6, timeout_s=30)
        out["subscriber"] = {
            "cpu_prefix_blocks": cpu_prefix(sub),
            "sources": sorted({src for (src, _medium, _group) in sub.view()}),
            "tiers": sorted({f"{src}/{medium}" for (src, medium, _g), blocks in sub.view().items() if blocks}),
            "next_seq": sub.next_seq,
            "gaps": sub.stats.gaps, "lost": sub.stats.lost, "malformed": sub.stats.malformed,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="127.0.0.1:50061")
    ap.add_argument("--pub", default="tcp://127.0.0.1:5557")
    ap.add_argument("--replay", default="tcp://127.0.0.1:5558")
    ap.add_argument("--num-gpu-blocks", type=int, default=16)
    args = ap.parse_args()
    json.dump(drive(args.engine, args.pub, args.replay, args.num_gpu_blocks), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
