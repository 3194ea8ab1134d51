"""The demo's cross-node part (``kv-stack --second-node``): new documents are read on node 1,
then the same documents on node 2, whose engine misses locally and is served from node 1's
host tier through node 2's daemon (issue 21); a third read on node 2 is a local CPU-tier hit
(or a GPU hit while its pool still holds them)."""

from __future__ import annotations

import random
import time

import httpx2

from stack.demo import complete
from stack.workload import document


def run_cross_node(node1_engine_url: str, node2_engine_url: str, n_docs: int = 3,
                   max_tokens: int = 4) -> list[tuple[float, float, int]]:
    """Per document: (TTFT on node 1, TTFT on node 2, tokens node 2 loaded from the host tier)."""
    rng = random.Random(21)
    rows: list[tuple[float, float, int]] = []
    print("\n  cross-node: each new document is read on node 1 (a miss), then on node 2, whose "
          "daemon fetches the blocks from node 1's tier", flush=True)
    with httpx2.Client(base_url=node1_engine_url, trust_env=False) as one, \
            httpx2.Client(base_url=node2_engine_url, trust_env=False) as two:
        for i in range(n_docs):
            prompt = document(rng, 100 + i, 60) + "Question: what is it about?"
            first = complete(one, prompt, max_tokens)
            time.sleep(0.3)  # node 1's stores are committed and node 2's fleet index has them
            second = complete(two, prompt, max_tokens)
            details = second.usage.get("prompt_tokens_details") or {}
            cpu = int(details.get("cpu_cached_tokens", 0))
            rows.append((first.ttft_s, second.ttft_s, cpu))
            print(f"  [doc{100 + i}] node 1 ttft {first.ttft_s * 1000:7.1f} ms (miss)   node 2 ttft "
                  f"{second.ttft_s * 1000:7.1f} ms, {cpu} of {second.usage.get('prompt_tokens', 0)} "
                  "prompt tokens loaded from node 1's blocks", flush=True)
    return rows
