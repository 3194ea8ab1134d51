#!/usr/bin/env python3
"""Stream a completion from a kv-engine over gRPC (the kvcache.v1.Generate service).

    python examples/generate_client.py --target 127.0.0.1:50061 "Document 1. The cache"
"""

from __future__ import annotations

import argparse
import time

import grpc
from kvcache.v1 import generate_pb2, generate_pb2_grpc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--target", default="127.0.0.1:50061")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    request = generate_pb2.GenerateRequest(
        text=args.prompt,
        sampling=generate_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature),
    )
    start = time.perf_counter()
    with grpc.insecure_channel(args.target) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        try:
            for i, msg in enumerate(stub.Generate(request, timeout=60)):
                if i == 0:
                    print(f"[first token after {(time.perf_counter() - start) * 1000:.1f} ms]")
                print(msg.text, end="", flush=True)
                if msg.finished:
                    print(f"\n[{msg.finish_reason}; prompt {msg.num_prompt_tokens} tokens, "
                          f"{msg.num_gpu_cached_tokens} from the GPU cache, "
                          f"{msg.num_cpu_cached_tokens} from the host tier]")
        except grpc.RpcError as exc:
            raise SystemExit(f"generate failed: {exc.code().name}: {exc.details()}") from None


if __name__ == "__main__":
    main()
