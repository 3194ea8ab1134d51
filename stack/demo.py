"""``kv-stack demo``: sends the workload through kv-router's OpenAI API (each request to the
engine it chooses, printed with the reason), follows the event stream through the bridge, then
prints a table of GPU hits, CPU-tier hits and misses with their time to first token and
writes a PNG timeline."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from events.subscriber import KvEventSubscriber
from stack.workload import DemoRequest, build

CATEGORIES = ("miss", "GPU hit", "CPU hit")


@dataclass(frozen=True)
class Outcome:
    request: DemoRequest
    engine: str
    reason: str
    predicted: int
    t_s: float
    ttft_s: float
    prompt_tokens: int
    gpu_cached: int
    cpu_cached: int
    gpu_blocks: int
    cpu_blocks: int

    @property
    def category(self) -> str:
        if self.cpu_cached:
            return "CPU hit"
        return "GPU hit" if self.gpu_cached else "miss"


@dataclass(frozen=True)
class Routed:
    """One streamed completion through the router: where it went, why, and what it reused."""

    engine: str
    reason: str
    predicted: int
    ttft_s: float
    usage: dict[str, Any]


def complete(client: httpx2.Client, prompt: str, max_tokens: int) -> Routed:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = 0.0
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"kv-router answered {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not ttft and chunk.get("choices"):  # the first token's chunk (its text may be held)
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
        h = resp.headers
        return Routed(h.get("x-kv-engine", "?"), h.get("x-kv-route-reason", "?"),
                      int(h.get("x-kv-predicted-cached-tokens", "0")), ttft, usage)


def tier_blocks(sub: KvEventSubscriber) -> tuple[int, int]:
    gpu = cpu = 0
    for (_, medium, _), n in sub.state.counts().items():
        if medium == "GPU":
            gpu += n
        else:
            cpu += n
    return gpu, cpu


def run_demo(router_url: str, pub: str, replay: str, topic: str, out_dir: Path, short: bool,
             max_tokens: int = 4) -> list[Outcome]:
    workload = build(short)
    sub = KvEventSubscriber(pub, replay, topic)
    sub.bootstrap()
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    phase = 0
    print(f"  every request goes through kv-router ({router_url}); it says which engine and why",
          flush=True)
    try:
        with httpx2.Client(base_url=router_url, trust_env=False) as client:
            for i, req in enumerate(workload, 1):
                if req.phase != phase:
                    phase = req.phase
                    print(f"\n  phase {phase}: {PHASES.get(phase, '')}", flush=True)
                r = complete(client, req.prompt, max_tokens)
                time.sleep(0.05)  # let the daemon commit the stores and the bridge publish them
                sub.catch_up()
                gpu, cpu = tier_blocks(sub)
                details = r.usage.get("prompt_tokens_details") or {}
                o = Outcome(req, r.engine, r.reason, r.predicted, time.perf_counter() - t0, r.ttft_s,
                            int(r.usage.get("prompt_tokens", 0)), int(details.get("gpu_cached_tokens", 0)),
                            int(details.get("cpu_cached_tokens", 0)), gpu, cpu)
                outcomes.append(o)
                print(f"  [{i:>2}/{len(workload)}] {req.label:<10} -> {o.engine:<9} {o.reason:<11} "
                      f"{o.category:<8} ttft {o.ttft_s * 1000:7.1f} ms  prompt {o.prompt_tokens:>4} "
                      f"gpu-cached {o.gpu_cached:>4} cpu-cached {o.cpu_cached:>4} "
                      f"(predicted {o.predicted})", flush=True)
        print_table(outcomes, sub)
        write_timeline(outcomes, out_dir / "demo-timeline.png")
    finally:
        sub.close()
    return outcomes


PHASES = {1: "documents read twice and chats that grow: the router follows their prefixes",
          2: "the documents a third time (host-tier hits on either engine) and two new ones"}


def print_table(outcomes: list[Outcome], sub: KvEventSubscriber) -> None:
    print("\n  kind        requests  prompt tok  cached tok  TTFT p50 ms  TTFT mean ms")
    for cat in CATEGORIES:
        rows = [o for o in outcomes if o.category == cat]
        if not rows:
            print(f"  {cat:<10} {0:>9}")
            continue
        ttfts = [o.ttft_s * 1000 for o in rows]
        prompt = statistics.mean(o.prompt_tokens for o in rows)
        cached = statistics.mean(o.gpu_cached + o.cpu_cached for o in rows)
        print(f"  {cat:<10} {len(rows):>9} {prompt:>11.0f} {cached:>11.0f} "
              f"{statistics.median(ttfts):>12.1f} {statistics.mean(ttfts):>13.1f}")
    first: dict[str, str] = {}
    for o in outcomes:
        first.setdefault(o.request.label.split()[0], o.engine)
    shared = [o for o in outcomes if o.category == "CPU hit" and o.engine != first[o.request.label.split()[0]]]
    exact = sum(o.predicted == o.gpu_cached + o.cpu_cached for o in outcomes)
    print(f"\n  requests served from prefixes another engine computed: {len(shared)}")
    print(f"  kv-router predicted the cached prefix exactly for {exact} of {len(outcomes)} requests")
    print("  blocks per source and tier, as a router rebuilds them from the bridge:")
    for (source, medium, group), n in sorted(sub.state.counts().items()):
        print(f"    {source:<22} {medium}  group {group}  {n:>5} blocks")
    sys.stdout.flush()


def write_timeline(outcomes: list[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    colors = {"miss": "tab:red", "GPU hit": "tab:green", "CPU hit": "tab:blue"}
    for cat in CATEGORIES:
        rows = [o for o in outcomes if o.category == cat]
        ax1.scatter([o.t_s for o in rows], [o.ttft_s * 1000 for o in rows], label=cat,
                    color=colors[cat], marker="o")
    ax1.set_ylabel("time to first token (ms)")
    ax1.legend()
    ax1.set_title("kvoffload demo: every request, by where its prefix came from")
    ts = [o.t_s for o in outcomes]
    ax2.step(ts, [o.gpu_blocks for o in outcomes], where="post", label="GPU-tier blocks")
    ax2.step(ts, [o.cpu_blocks for o in outcomes], where="post", label="CPU-tier blocks")
    ax2.set_xlabel("seconds since start")
    ax2.set_ylabel("blocks (from the event stream)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"  timeline written to {path}")
