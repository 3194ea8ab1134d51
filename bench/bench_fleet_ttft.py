"""Cross-node tier, end to end: an engine on node B served from node A's tier, vs cold, vs a
local CPU-tier hit.

    python bench/bench_fleet_ttft.py [--prompt-len 1000] [--rounds 10]
                                     [--out bench/results/fleet_ttft.json]

Two real daemons on loopback sharing one Redis (namespaces node-a and node-b; B started with
``--fleet-peers a=<A>/node-a``), and two engines of the same tiny model in this process, engine
A on daemon A, engine B on daemon B, each with the real offload connector. Per round, a new
random prompt of ``--prompt-len`` tokens, one output token (TTFT):

- **cold**: engine A computes it (nothing cached anywhere); its blocks are offloaded to A;
- **remote hit**: engine B's admission Lookup misses on B; daemon B reads the prefix from A
  (pin, ReadBlocks with checksums), stores it (BlockStored provenance "fleet:a"), answers the
  Lookup, and engine B loads it as a CPU-tier hit;
- **local CPU hit**: B's GPU prefix cache reset, the same prompt again: now in B's own tier.

The first token of the remote and local hits must equal the cold one. Goal (issue 21): remote
hit >= 3x faster than cold (median ratio) and faster in 10 of 10 rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.llm import LLM
from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from engine.offload.config import OffloadConnectorConfig
from engine.offload.connector import OffloadingConnector
from engine.sampling import SamplingParams
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess, free_port

BS = 16
# The e2e suite's tiny model (tests/e2e/test_cpu_offload.py): ~1000-token prefills of a few
# hundred ms on 2 cores, 4 MiB of KV.
SPEC = TinyModelSpec(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=4,
                     num_heads=8, num_kv_heads=2, max_position_embeddings=4096)


def _engine(model: Path, target: str, engine_id: str, prompt_len: int) -> tuple[LLM, OffloadingConnector]:
    conn = OffloadingConnector(OffloadConnectorConfig(target, engine_id, "bench-tiny"))
    llm = LLM(str(model), connector=conn, device="cpu", dtype="float32",
              num_gpu_blocks=prompt_len // BS * 3 + 8, max_num_batched_tokens=prompt_len + BS,
              max_model_len=prompt_len + 64)
    return llm, conn


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))[0]
    return time.perf_counter() - t0, out.num_external_cached_tokens, out.outputs[0].token_ids[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="bench/results/fleet_ttft.json")
    ap.add_argument("--block-port", action="store_true",
                    help="node B reads A's blocks through A's --fleet-block-port (raw TCP)")
    args = ap.parse_args()
    rng = random.Random(0)
    rows: list[dict[str, float | int | bool]] = []
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # arenas on tmpfs, as in production
    with tempfile.TemporaryDirectory(prefix="bench-fleet-ttft-", dir=shm) as tmp:
        work = Path(tmp)
        model = write_tiny_model(work / "model", SPEC)
        redis_proc = RedisProcess(work / "redis")
        redis_proc.start()
        quiet = ("--log-level", "WARNING")
        bport = free_port()
        a = DaemonProcess(work / "a", redis_proc.url, "node-a", capacity_bytes=1 << 30, chunk_bytes=256 << 20,
                          extra_args=(*quiet, "--fleet-block-port", str(bport)) if args.block_port else quiet)
        peer = f"a={a.target}/node-a" + (f"@{bport}" if args.block_port else "")
        a.start()
        b = DaemonProcess(work / "b", redis_proc.url, "node-b", capacity_bytes=1 << 30,
                          chunk_bytes=256 << 20, extra_args=(
                              *quiet, "--fleet-peers", peer, "--fleet-refresh-ms", "20"))
        b.start()
        try:
            llm_a, conn_a = _engine(model, a.target, "engine-a", args.prompt_len)
            llm_b, conn_b = _engine(model, b.target, "engine-b", args.prompt_len)
            for llm in (llm_a, llm_b):  # first-call costs are not the tier's
                _ttft(llm, [rng.randrange(SPEC.vocab_size) for _ in range(args.prompt_len)])
            assert conn_a.flush() and conn_b.flush()
            want_ext = (args.prompt_len - 1) // BS * BS
            for i in range(args.rounds):
                prompt = [rng.randrange(SPEC.vocab_size) for _ in range(args.prompt_len)]
                cold, ext_cold, tok = _ttft(llm_a, prompt)
                assert ext_cold == 0 and conn_a.flush()
                time.sleep(0.1)  # B's fleet index follows A's log (every 20 ms)
                remote, ext_remote, tok_remote = _ttft(llm_b, prompt)
                assert conn_b.flush() and llm_b.reset_prefix_cache()
                local, ext_local, tok_local = _ttft(llm_b, prompt)
                assert conn_b.flush() and llm_b.reset_prefix_cache() and llm_a.reset_prefix_cache()
                rows.append({"cold_s": cold, "remote_hit_s": remote, "local_cpu_hit_s": local,
                             "remote_ext_tokens": ext_remote, "local_ext_tokens": ext_local,
                             "same_token": tok == tok_remote == tok_local})
                print(f"round {i}: cold {cold * 1e3:7.1f} ms  remote hit {remote * 1e3:6.1f} ms "
                      f"({ext_remote} tokens)  local CPU hit {local * 1e3:6.1f} ms ({ext_local})")
            conn_a.close()
            conn_b.close()
        finally:
            a.kill()
            b.kill()
            redis_proc.stop()
    med = {k: statistics.median(float(r[k]) for r in rows) for k in ("cold_s", "remote_hit_s", "local_cpu_hit_s")}
    wins = sum(float(r["remote_hit_s"]) < float(r["cold_s"]) for r in rows)
    served = sum(r["remote_ext_tokens"] == want_ext for r in rows)
    summary = {
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "cold_over_remote_hit": med["cold_s"] / med["remote_hit_s"],
        "cold_over_local_cpu_hit": med["cold_s"] / med["local_cpu_hit_s"],
        "remote_hit_wins": f"{wins}/{len(rows)}",
        "remote_rounds_fully_served": f"{served}/{len(rows)}",
        "same_first_token": all(bool(r["same_token"]) for r in rows),
    }
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "args": vars(args), "model": vars(SPEC),
                               "summary": summary, "rounds": rows}, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
