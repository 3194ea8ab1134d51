"""``kv-stack``: the whole kvoffload stack as local processes (no Docker needed).

    kv-stack up              start redis (unless REDIS_URL), offloadd, kv-bridge, two engines and
                             kv-router in front of them, run the demo through the router, then
                             keep serving until Ctrl-C / SIGTERM
    kv-stack up --no-demo    just the stack
    kv-stack demo --short    start, run a short demo, stop (what CI runs)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from rpc.logs import redact_url
from stack.launcher import Stack, StackConfig
from stack.supervisor import StackError


class Stop(Exception):
    """SIGTERM or SIGINT: stop every process cleanly."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-stack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="up", choices=["up", "demo"])
    p.add_argument("--run-dir", default=os.environ.get("KV_RUN_DIR", "run"),
                   help="logs, the private Redis's data, the demo model and PNG (default ./run)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""),
                   help="use this Redis instead of starting a private redis-server (env REDIS_URL)")
    p.add_argument("--namespace", default=os.environ.get("KV_NAMESPACE", "demo"),
                   help="offloadd's namespace: its Redis keys and arena file names (env KV_NAMESPACE; "
                        "default demo); one kv-stack per namespace and arena directory")
    p.add_argument("--model", default=None, help="a Hugging Face model directory (default: a small random one)")
    p.add_argument("--hybrid", action="store_true", help="the random model gets sliding-window layers")
    p.add_argument("--gpu-blocks", type=int, default=48, help="GPU-tier (KV pool) blocks per engine")
    p.add_argument("--arena-bytes", type=int, default=512 << 20, help="host-tier capacity")
    p.add_argument("--arena-dir", default="/dev/shm", help="where the host tier's shared-memory files go")
    p.add_argument("--keep-arena", action="store_true",
                   help="leave the host tier's files in --arena-dir after a stop, for the next start "
                        "to recover (default: removed, so a stop frees that memory)")
    p.add_argument("--engines", type=int, default=2, help="engines behind kv-router")
    p.add_argument("--policy", default="kv", choices=["kv", "round-robin", "least-loaded", "random"],
                   help="kv-router's routing policy")
    p.add_argument("--vllm-demo", action="store_true",
                   help="also a vLLM-style engine (ZMQ publisher) followed by kv-ingest into the log")
    p.add_argument("--second-node", action="store_true",
                   help="also a second node (own offloadd and arena, one engine, the same Redis) "
                        "whose engine is served from the first node's host tier")
    p.add_argument("--no-demo", action="store_true", help="start the stack only")
    p.add_argument("--short", action="store_true", help="a shorter demo workload")
    return p


def _next_steps(router: str, pub: str, replay: str, topic: str, run_dir: Path) -> str:
    kvctl = Path(sys.executable).with_name("kvctl")
    body = '{"model": "demo", "prompt": "hello", "max_tokens": 8}'
    return (f"  next:\n"
            f"    curl -si {router}/v1/completions -H 'content-type: application/json' -d '{body}'\n"
            f"        a completion through kv-router: headers x-kv-engine, x-kv-route-reason say where and why\n"
            f"    {kvctl} tail --pub {pub} --replay {replay} --topic {topic}\n"
            f"        the KV events as the engines and offloadd log them (Ctrl-C ends it)\n"
            f"    {router}/   the router's fleet page in a browser; logs in {run_dir}/*.log\n")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, value in (("--engines", args.engines), ("--gpu-blocks", args.gpu_blocks),
                        ("--arena-bytes", args.arena_bytes)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.model and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (a Hugging Face model directory)")
    run_dir = Path(args.run_dir).resolve()
    config = StackConfig(
        run_dir=run_dir, redis_url=args.redis_url, namespace=args.namespace,
        model_dir=Path(args.model).resolve() if args.model else None, hybrid=args.hybrid,
        arena_bytes=args.arena_bytes, num_gpu_blocks=args.gpu_blocks, arena_dir=args.arena_dir,
        num_engines=args.engines, router_policy=args.policy, vllm_demo=args.vllm_demo,
        second_node=args.second_node, keep_arena=args.keep_arena,
    )
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        stack = Stack(config)
    except OSError as exc:
        print(f"kv-stack: error: cannot use the run directory {run_dir}: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"kv-stack: starting in {run_dir}", flush=True)
        ep = stack.up()
        print(f"\n  redis     {redact_url(ep.redis_url)}\n  offloadd  {ep.offloadd} (metrics {ep.offloadd_metrics})"
              f"\n  bridge    PUB {ep.bridge_pub}  replay {ep.bridge_replay}  topic {config.topic!r}"
              + "".join(f"\n  engine-{n}  {target} (gRPC Generate)  {url} (OpenAI HTTP)"
                        for n, (target, url) in enumerate(zip(ep.engines, ep.engine_urls, strict=True)))
              + f"\n  router    {ep.router}/v1 (OpenAI HTTP, policy {config.router_policy})  page {ep.router}/"
              f"\n            {ep.router_grpc} (gRPC Generate)"
              + (f"\n  vllm-demo {ep.vllm_demo} (vLLM-style publisher) -> kv-ingest (metrics "
                 f"{ep.ingest_metrics}) -> the log as source 'vllm-demo'" if ep.vllm_demo else "")
              + (f"\n  node 2    offloadd {ep.node2_offloadd} (fleet peer: {ep.offloadd})  engine "
                 f"{ep.node2_engine_url} (OpenAI HTTP)" if ep.node2_offloadd else "")
              + "\n",
              flush=True)
        if not args.no_demo:
            from stack.demo import run_demo

            run_demo(ep.router, ep.bridge_pub, ep.bridge_replay, config.topic, run_dir, args.short)
            if ep.node2_engine_url:
                from stack.second_node import run_cross_node

                run_cross_node(ep.engine_urls[0], ep.node2_engine_url)
            print()
        if args.command == "demo":
            return 0
        print(_next_steps(ep.router, ep.bridge_pub, ep.bridge_replay, config.topic, run_dir), flush=True)
        print("kv-stack: the stack is up; Ctrl-C stops it.", flush=True)
        while True:
            stack.sup.check_alive()
            time.sleep(0.5)
    except Stop as why:
        print(f"\nkv-stack: {why}: stopping", flush=True)
        return 0
    except StackError as exc:
        print(f"kv-stack: error: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.down()
        print("kv-stack: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
