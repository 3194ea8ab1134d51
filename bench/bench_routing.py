"""KV-aware routing vs round-robin vs least-loaded, same requests, one run (issue 20).

Live part, per policy on a fresh stack: Redis, offloadd, kv-bridge, N engines (``kv-engine
serve --http-port``, a small random model on CPU, GPU pools smaller than the workload's
distinct prefixes) and kv-router with that policy; the same request list (document Q&A with
Zipf-skewed popularity and multi-turn chats, all sharing prefixes) is streamed through the
router by a few concurrent clients with the official ``openai`` package. Per policy: cached
prompt tokens (what the engines report), TTFT at the client, the router's prediction agreement.

Decision part, apart from the model: the router's per-request work (hash the tokenized prompt
once, score every engine) on a CacheState holding 100,000 resident blocks over 16 engines.

    python bench/bench_routing.py                      # both parts, JSON to bench/results/routing.json
    python bench/bench_routing.py --decision-only
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.model.checkpoint import TinyModelSpec, write_tiny_model  # noqa: E402
from events.hashing import BlockHasher, to_wire  # noqa: E402
from events.schema import BlockStored, LogRecord  # noqa: E402
from events.state import CacheState  # noqa: E402
from router.config import EngineSpec, RouterConfig  # noqa: E402
from router.fleet import EngineState  # noqa: E402
from router.policy import Chooser  # noqa: E402
from router.service import OFF_LOOP_MIN_SIZE, Router  # noqa: E402
from router.truth import OUTCOMES  # noqa: E402
from stack.workload import WORDS  # noqa: E402
from tests.router.procs import Proc, engine, router  # noqa: E402
from tests.support.bridge_proc import BridgeProcess  # noqa: E402
from tests.support.offloadd_proc import DaemonProcess  # noqa: E402
from tests.support.redis_proc import RedisProcess  # noqa: E402

POLICIES = ("kv", "round-robin", "least-loaded")
MODEL = dict(hidden_size=256, intermediate_size=768, num_layers=6, num_heads=8, num_kv_heads=4,
             max_position_embeddings=4096)


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def workload(seed: int, n_requests: int, n_docs: int, n_chats: int, max_turns: int = 5) -> list[str]:
    """Document questions (Zipf popularity, s=1.1) and chat turns (each extends its history;
    a chat of ``max_turns`` turns is replaced by a new one)."""
    rng = random.Random(seed)
    docs = [f"Document {i}. {_text(rng, 70)}.\n" for i in range(n_docs)]
    weights = [1 / (i + 1) ** 1.1 for i in range(n_docs)]
    started = 0

    def new_chat() -> list[str]:
        nonlocal started
        started += 1
        return [f"System: you are assistant {started}. {_text(rng, 30)}.\n"]

    chats = [new_chat() for _ in range(n_chats)]
    out: list[str] = []
    while len(out) < n_requests:
        if rng.random() < 0.6:
            doc = rng.choices(docs, weights)[0]
            out.append(f"{doc}Question: {_text(rng, 6)}?\nAnswer:")
        else:
            c = rng.randrange(n_chats)
            if len(chats[c]) > max_turns:
                chats[c] = new_chat()
            chats[c].append(f"User: {_text(rng, 10)}\nAssistant: {_text(rng, 6)}\n")
            out.append("".join(chats[c]) + "Assistant:")
    return out


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _metric(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


LEVERS = {"kv, no hold, no pressure model": (True, True), "kv, hold only": (False, True),
          "kv, pressure model only": (True, False)}
"""``--levers``: the KV-aware policy again without the engines' prefix holds and/or the router's
pressure model, name -> (--no-prefix-hold, --no-pressure-model)."""


def run_policy(policy: str, prompts: list[str], args: argparse.Namespace, model: Path, work: Path,
               redis_url: str, no_hold: bool = False, no_pressure: bool = False) -> dict[str, Any]:
    import openai

    work.mkdir(parents=True)
    daemon = DaemonProcess(work / "offloadd", redis_url, namespace=f"bench-{work.name}",
                           capacity_bytes=256 << 20, chunk_bytes=64 << 20)
    bridge = BridgeProcess(redis_url, work / "bridge", namespace=f"bench-{work.name}")
    procs: list[Proc] = []
    try:
        daemon.start()
        bridge.start()
        engines = [engine(work, f"e{i}", model, daemon.target, gpu_blocks=args.gpu_blocks) for i in range(args.engines)]
        if not args.offload:  # events go to the log; no host tier
            for e in engines:
                e.args.remove("--offload")
        if args.no_prefix_hold or no_hold:  # match cached prefixes only at admission (engine.prefix_holds)
            for e in engines:
                e.args.append("--no-prefix-hold")
        for e in engines:
            procs.append(e.start(120))
        for e in engines:  # first steps of a fresh process are slow: not part of any policy's numbers
            warm = openai.OpenAI(base_url=f"{e.url}/v1", api_key="none", max_retries=0)
            for n in (300, 500):
                warm.completions.create(model="tiny", prompt=f"warm-up {e.name} " + "x" * n, max_tokens=2)
        front = router(work, engines, f"--policy={policy}", f"--bridge-pub={bridge.pub}",
                       f"--bridge-replay={bridge.replay}", f"--model={model}",
                       *(["--no-pressure-model"] if args.no_pressure_model or no_pressure else []))
        procs.append(front.start())
        results: list[dict[str, Any]] = []
        queue = list(enumerate(prompts))
        lock = threading.Lock()

        def client_loop() -> None:
            client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="none", max_retries=0)
            while True:
                with lock:
                    if not queue:
                        return
                    i, prompt = queue.pop(0)
                start = time.perf_counter()
                ttft = None
                usage = None
                for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=args.max_tokens,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True}):
                    if ttft is None and chunk.choices:  # the first token's chunk
                        ttft = time.perf_counter() - start
                    if chunk.usage is not None:
                        usage = chunk.usage
                assert usage is not None and usage.prompt_tokens_details is not None
                with lock:
                    results.append({"i": i, "ttft_s": ttft or (time.perf_counter() - start),
                                    "prompt_tokens": usage.prompt_tokens,
                                    "cached_tokens": usage.prompt_tokens_details.cached_tokens})

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client_loop) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        metrics = _get(f"{front.url}/metrics")
        health = {e.name: json.loads(_get(f"{e.url}/health")) for e in engines}
        ttfts = sorted(r["ttft_s"] * 1000 for r in results)
        outcomes = {o: _metric(metrics, "kv_router_predictions_total", f'outcome="{o}"')
                    for o in OUTCOMES}
        n_out = sum(outcomes.values())
        misses = [line.split("prediction ", 1)[1] for line in front.log_path.read_text().splitlines()
                  if "prediction " in line and " for " in line]
        return {
            "policy": policy, "requests": len(results), "wall_s": round(wall, 2),
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "cached_tokens": sum(r["cached_tokens"] for r in results),
            "ttft_ms_mean": round(statistics.mean(ttfts), 2), "ttft_ms_p50": round(ttfts[len(ttfts) // 2], 2),
            "ttft_ms_p99": round(ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))], 2),
            "prediction_outcomes": outcomes,
            "prediction_agreement": round(outcomes["agree"] / n_out, 4) if n_out else None,
            "prediction_misses": misses,
            "engine_holds": {name: {k: h.get(k) for k in ("prefix_holds", "prefix_holds_dropped")}
                             for name, h in health.items()},
            "requests_per_engine": {e.name: _metric(metrics, "kv_router_engine_requests_total", f'engine="{e.name}"')
                                    for e in engines},
        }
    finally:
        for p in reversed(procs):
            p.stop()
        bridge.stop()
        daemon.stop()


def decision_bench(n_engines: int = 16, total_blocks: int = 100_000, n_requests: int = 5_000,
                   prompt_tokens: int = 2048, seed: int = 0) -> dict[str, Any]:
    """Hash + score per request on a state of ``total_blocks`` GPU blocks over ``n_engines``.

    Three ways, interleaved request by request on the same prompts: the router's hashing
    (router.block_hashes) and scoring on the calling thread (wall and thread CPU time); the
    baseline, the owner's general fast path (``events.hashing.BlockHasher.hash_blocks`` and
    ``to_wire``), as the router hashed before; and the router's path as it serves, the hashing
    on its hashing thread awaited from an asyncio loop, then the scoring on the loop."""
    import asyncio

    rng = random.Random(seed)
    bs = 16
    config = RouterConfig(engines=tuple(EngineSpec(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(n_engines)),
                          block_size=bs)
    per_prompt = prompt_tokens // bs
    n_prefixes = total_blocks // per_prompt  # each engine holds whole prefixes: realistic chains
    prefixes = [[rng.randrange(32000) for _ in range(prompt_tokens)] for _ in range(n_prefixes)]
    hasher = BlockHasher(config.hash_seed, bs)
    state = CacheState()
    for p_i, tokens in enumerate(prefixes):
        stored = tuple(to_wire(d) for d in hasher.hash_blocks(tokens))
        ev = BlockStored(stored, None, tuple(tokens), bs, "GPU")
        state.apply(LogRecord(p_i + 1, f"e{p_i % n_engines}", 0, 0, 0.0, (ev,)))
    resident = sum(state.counts().values())
    gc.freeze()  # as the router's follower does with its state (router.follower)
    r = Router(config, None, None)  # type: ignore[arg-type]  # no forwarding here
    engines = [EngineState(s, healthy=True) for s in config.engines]
    chooser = Chooser(config)
    times: dict[str, list[float]] = {k: [] for k in ("hash", "score", "total", "cpu", "base_hash", "base_cpu",
                                                      "loop_total")}

    async def off_loop(ids: list[int]) -> float:
        t0 = time.perf_counter()
        hashes = await r.off_loop(lambda: r.hashes(ids), OFF_LOOP_MIN_SIZE)  # the thread, whatever the size
        chooser.choose(engines, hashes, state)
        return time.perf_counter() - t0

    loop = asyncio.new_event_loop()
    try:
        for _ in range(n_requests):
            base = rng.choice(prefixes)
            cut = rng.randrange(prompt_tokens // 2, prompt_tokens)  # a cached prefix, then new tokens
            ids = base[:cut] + [rng.randrange(32000) for _ in range(prompt_tokens - cut)]
            c0 = time.thread_time()
            t0 = time.perf_counter()
            hashes = r.hashes(ids)
            t1 = time.perf_counter()
            chooser.choose(engines, hashes, state)
            t2 = time.perf_counter()
            times["cpu"].append(time.thread_time() - c0)
            times["hash"].append(t1 - t0)
            times["score"].append(t2 - t1)
            times["total"].append(t2 - t0)
            n = (len(ids) - 1) // bs * bs
            c0 = time.thread_time()
            t0 = time.perf_counter()
            base_hashes = [to_wire(d) for d in hasher.hash_blocks(ids[:n])]
            times["base_hash"].append(time.perf_counter() - t0)
            times["base_cpu"].append(time.thread_time() - c0)
            assert base_hashes == hashes
            times["loop_total"].append(loop.run_until_complete(off_loop(ids)))
    finally:
        loop.close()
        r.close()

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(len(xs) * q))] * 1e6, 1)

    out: dict[str, Any] = {"engines": n_engines, "resident_blocks": resident, "prompt_tokens": prompt_tokens,
                           "requests": n_requests}
    names = {"total": "decision", "cpu": "decision_cpu", "hash": "hash", "score": "score",
             "base_hash": "baseline_hash", "base_cpu": "baseline_hash_cpu", "loop_total": "decision_via_hash_thread"}
    for key, name in names.items():
        out[f"{name}_us_p50"] = pct(times[key], 0.5)
        out[f"{name}_us_p99"] = pct(times[key], 0.99)
    out["hash_speedup_p50"] = round(out["baseline_hash_us_p50"] / out["hash_us_p50"], 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--gpu-blocks", type=int, default=128, help="GPU pool per engine (blocks of 16 tokens)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--offload", action="store_true", help="engines share the node's host tier too")
    p.add_argument("--no-prefix-hold", action="store_true",
                   help="engines match a queued request's prefix at admission only (kv-engine --no-prefix-hold)")
    p.add_argument("--no-pressure-model", action="store_true",
                   help="the router predicts from the event view alone (kv-router --no-pressure-model)")
    p.add_argument("--levers", action="store_true",
                   help="then the KV-aware policy again without the engines' prefix holds, without the "
                        "router's pressure model, and without both (issue 20's agreement levers)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, in this order (default: {','.join(POLICIES)})")
    p.add_argument("--decision-only", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing.json"))
    args = p.parse_args()
    policies = [x for x in args.policies.split(",") if x]
    if not policies or set(policies) - set(POLICIES):
        p.error(f"--policies: choose from {','.join(POLICIES)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stack's processes too
    out: dict[str, Any] = {"machine": platform.node(), "cpus": __import__("os").cpu_count(),
                           "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)}
    print("decision time, apart from the model ...", flush=True)
    out["decision"] = decision_bench()
    print(json.dumps(out["decision"]), flush=True)
    if not args.decision_only:
        prompts = workload(args.seed, args.requests, args.docs, args.chats)
        with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
            work = Path(tmp)
            model = write_tiny_model(work / "model", TinyModelSpec(**MODEL))  # type: ignore[arg-type]
            redis = RedisProcess(work / "redis")
            redis.start()
            try:
                out["policies"] = {}
                for policy in policies:
                    print(f"policy {policy}: {len(prompts)} requests ...", flush=True)
                    res = run_policy(policy, prompts, args, model, work / policy, redis.url)
                    out["policies"][policy] = res
                    print(json.dumps(res), flush=True)
                for i, (name, (no_hold, no_pressure)) in enumerate(LEVERS.items() if args.levers else ()):
                    print(f"{name}: {len(prompts)} requests ...", flush=True)
                    res = run_policy("kv", prompts, args, model, work / f"levers{i}", redis.url, no_hold, no_pressure)
                    out["policies"][name] = res
                    print(json.dumps(res), flush=True)
            finally:
                redis.stop()
        if {"kv", "round-robin"} <= set(policies):
            kv, rr = out["policies"]["kv"], out["policies"]["round-robin"]
            out["kv_vs_round_robin"] = {
                "cached_tokens_ratio": round(kv["cached_tokens"] / max(rr["cached_tokens"], 1), 2),
                "mean_ttft_speedup": round(rr["ttft_ms_mean"] / kv["ttft_ms_mean"], 2),
            }
            print(json.dumps(out["kv_vs_round_robin"]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
