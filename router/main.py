"""``kv-router``: sends each OpenAI request to the engine where its prompt's prefix is cached.

It follows kv-bridge (snapshot, live stream, gap fill) to know which blocks sit in each engine's
GPU tier and in its node's host tier, scores the engines in rotation against their load, and
forwards the request (streamed or not) to the best one, trying another when an engine fails
before any token was sent. Example:

  kv-router --engine e0=http://127.0.0.1:8001 --engine e1=http://127.0.0.1:8002 \\
            --bridge-pub tcp://127.0.0.1:5557 --bridge-replay tcp://127.0.0.1:5558 --model DIR

Serves /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /status and the
fleet page on --port, and gRPC Generate on --grpc-port.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from events.hashing import env_hash_seed
from router.config import POLICIES, EngineSpec, RouterConfig, RouterConfigError, engines_from_file
from rpc.logs import LOG_LEVELS, log_level

log = logging.getLogger("kv-router")


def _parser() -> argparse.ArgumentParser:
    d = RouterConfig(engines=(EngineSpec("x", "http://x"),))
    p = argparse.ArgumentParser(prog="kv-router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", default=[], metavar="NAME=URL[,source=ID][,node=SOURCE][,grpc=HOST:PORT]",
                   help="an engine's OpenAI HTTP base URL; source: its --engine-id in the event log "
                        "(default NAME); node: its node's host-tier source (default offloadd); grpc: its "
                        "Generate target, for --grpc-port. Repeat per engine")
    p.add_argument("--config", default=None, metavar="TOML",
                   help="engines from [[engines]] tables (name, url, source, node), added to --engine")
    p.add_argument("--policy", default=d.policy, choices=POLICIES,
                   help="kv: by cached prefix against load (default); others ignore the cache")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="HTTP port (OpenAI API, /health, /metrics, page)")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port,
                   help="serve gRPC Generate in front of the engines with a grpc= target (-1: off)")
    p.add_argument("--bridge-pub", default="", help="kv-bridge PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--bridge-replay", default="", help="kv-bridge replay endpoint, e.g. tcp://127.0.0.1:5558")
    p.add_argument("--topic", default=d.topic, help="the bridge's topic")
    p.add_argument("--model", default="", metavar="DIR",
                   help="the engines' model directory: tokenizer.json and chat template (default: bytes, plain)")
    p.add_argument("--served-model-name", default="", help="model name for clients (default: model dir name)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="the engines' tokens per block")
    p.add_argument("--hash-seed", default=env_hash_seed(os.environ),
                   help="the engines' block-hash seed (default: $PYTHONHASHSEED, else %(default)r, as the engines)")
    p.add_argument("--hash-algo", default=d.hash_algo, choices=["sha256_cbor", "xxh3_128_cbor"])
    p.add_argument("--gpu-weight", type=float, default=d.gpu_weight, help="score per GPU-tier cached token")
    p.add_argument("--cpu-weight", type=float, default=d.cpu_weight, help="score per host-tier cached token")
    p.add_argument("--load-weight", type=float, default=d.load_weight,
                   help="score taken off per request in flight on an engine")
    p.add_argument("--no-pressure-model", action="store_true",
                   help="predict an engine's cached prefix from the event view alone (by default the "
                        "router adds its finished requests' blocks not yet in the view and takes off the "
                        "blocks its requests in flight will evict, from the pool size in the engines' /health)")
    p.add_argument("--health-interval-s", type=float, default=d.health_interval_s)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--max-attempts", type=int, default=d.max_attempts,
                   help="engines tried per request (another only while no token was sent)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random policy")
    p.add_argument("--log-level", type=log_level, default="INFO", help=f"one of {', '.join(LOG_LEVELS)}")
    return p


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    engines = [EngineSpec.parse(e) for e in a.engine]
    if a.config:
        engines += engines_from_file(a.config)
    return RouterConfig(
        engines=tuple(engines), policy=a.policy, host=a.host, port=a.port, grpc_port=a.grpc_port,
        bridge_pub=a.bridge_pub,
        bridge_replay=a.bridge_replay, topic=a.topic, model_dir=a.model, served_model_name=a.served_model_name,
        block_size=a.block_size, hash_seed=a.hash_seed, hash_algo=a.hash_algo, gpu_weight=a.gpu_weight,
        cpu_weight=a.cpu_weight, load_weight=a.load_weight, model_pressure=not a.no_pressure_model,
        health_interval_s=a.health_interval_s,
        request_timeout_s=a.request_timeout_s, max_attempts=a.max_attempts, seed=a.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        return serve(config)
    except (RouterConfigError, ValueError, OSError) as exc:
        print(f"kv-router: error: {exc}", file=sys.stderr)
        return 2


def serve(config: RouterConfig) -> int:
    import httpx2
    import uvicorn

    from router.app import create_app
    from router.follower import Follower
    from router.service import Router
    from rpc.http_server import bind_socket

    if config.grpc_port > 0:  # a taken gRPC port, found before the HTTP side starts (it binds later)
        bind_socket(config.host, config.grpc_port).close()
    sock = bind_socket(config.host, config.port)  # before anything starts: a taken port is one line
    follower: Follower | None = None
    client = httpx2.AsyncClient(limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=100),
                                trust_env=False)
    try:
        if config.bridge_pub:
            follower = Follower(config.bridge_pub, config.bridge_replay, config.topic).start()
        router = Router(config, client, follower)
        server = uvicorn.Server(uvicorn.Config(create_app(router), log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=5))
        print(f"kv-router: serving on port {sock.getsockname()[1]} ({len(config.engines)} engines, "
              f"policy {config.policy})", flush=True)
        # uvicorn stops gracefully on SIGTERM/SIGINT (in-flight requests finish), then re-raises
        # the signal into the handlers it found: these, so that the process exits 0.
        stopped: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: stopped.append(signum))
        try:
            server.run(sockets=[sock])
        except SystemExit:  # uvicorn's exit when the app's startup failed; it logged why
            print("kv-router: error: could not start (see the log above)", file=sys.stderr)
            return 1
        if stopped:
            log.info("stopped by %s", signal.Signals(stopped[0]).name)
    finally:
        if follower is not None:
            follower.stop()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
