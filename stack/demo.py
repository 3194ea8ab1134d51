"""``kv-stack demo``: drives the workload through the engines' Generate API, follows the event
stream through the bridge, then prints a table of GPU hits, CPU-tier hits and misses with
their time to first token and writes a PNG timeline."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from kvcache.v1 import generate_pb2, generate_pb2_grpc

from events.subscriber import KvEventSubscriber
from stack.workload import DemoRequest, build

CATEGORIES = ("miss", "GPU hit", "CPU hit")


@dataclass(frozen=True)
class Outcome:
    request: DemoRequest
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


def generate(stub: generate_pb2_grpc.GenerateStub, prompt: str, max_tokens: int
             ) -> tuple[float, generate_pb2.GenerateResponse]:
    req = generate_pb2.GenerateRequest(
        text=prompt, sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    ttft = 0.0
    last = generate_pb2.GenerateResponse()
    for msg in stub.Generate(req, timeout=120):
        if not ttft and msg.token_ids:
            ttft = time.perf_counter() - start
        last = msg
    return ttft, last


def tier_blocks(sub: KvEventSubscriber) -> tuple[int, int]:
    gpu = cpu = 0
    for (_, medium, _), n in sub.state.counts().items():
        if medium == "GPU":
            gpu += n
        else:
            cpu += n
    return gpu, cpu


def run_demo(engines: list[str], add_engine: Callable[[], str], pub: str, replay: str,
             topic: str, out_dir: Path, short: bool, max_tokens: int = 4) -> list[Outcome]:
    workload = build(short)
    sub = KvEventSubscriber(pub, replay, topic)
    sub.bootstrap()
    stubs: dict[int, generate_pb2_grpc.GenerateStub] = {}
    channels: list[grpc.Channel] = []
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    try:
        for i, req in enumerate(workload, 1):
            if req.engine >= len(engines):
                print(f"\n  phase {req.phase}: a second engine joins the same daemon", flush=True)
                engines.append(add_engine())
            if req.engine not in stubs:
                channels.append(grpc.insecure_channel(engines[req.engine]))
                stubs[req.engine] = generate_pb2_grpc.GenerateStub(channels[-1])
            ttft, last = generate(stubs[req.engine], req.prompt, max_tokens)
            time.sleep(0.05)  # let the daemon commit the stores and the bridge publish them
            sub.catch_up()
            gpu, cpu = tier_blocks(sub)
            o = Outcome(req, time.perf_counter() - t0, ttft, last.num_prompt_tokens,
                        last.num_gpu_cached_tokens, last.num_cpu_cached_tokens, gpu, cpu)
            outcomes.append(o)
            print(f"  [{i:>2}/{len(workload)}] engine-{req.engine} {req.label:<10} "
                  f"{o.category:<8} ttft {o.ttft_s * 1000:7.1f} ms  prompt {o.prompt_tokens:>4} "
                  f"gpu-cached {o.gpu_cached:>4} cpu-cached {o.cpu_cached:>4}", flush=True)
        print_table(outcomes, sub)
        write_timeline(outcomes, out_dir / "demo-timeline.png")
    finally:
        for ch in channels:
            ch.close()
        sub.close()
    return outcomes


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
    shared = [o for o in outcomes if o.request.engine == 1 and o.category == "CPU hit"]
    print(f"\n  engine-1 requests served from prefixes engine-0 computed: {len(shared)}")
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
