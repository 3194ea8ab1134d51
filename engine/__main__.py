"""``kv-engine``: serve (gRPC Generate, and OpenAI HTTP with --http-port), generate (one-off),
make-tiny-model (random checkpoint)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from events.hashing import DEFAULT_SEED, env_hash_seed

# The engine needs the `engine` extra; without it every command (--help too) says so in one line.
ENGINE_EXTRA: Final = frozenset({"torch", "safetensors", "tokenizers"})
_missing: str | None = None
try:
    from engine.config import DTYPES, EngineConfig, default_engine_id
    from engine.errors import EngineError
    from engine.model.checkpoint import TinyModelSpec, write_tiny_model
    from engine.model.config import ModelConfigError
    from engine.sampling import SamplingParams
except ModuleNotFoundError as exc:
    if exc.name not in ENGINE_EXTRA:
        raise
    _missing = exc.name

log = logging.getLogger("engine")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="weights and KV cache dtype (bfloat16/float16 on CUDA)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-gpu-blocks", type=int, default=256,
                   help="KV pool size in blocks per KV-cache group (the device tier)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step (prefill chunks + decodes)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--hash-seed", default=env_hash_seed(os.environ),
                   help="block-hash seed, as vLLM's PYTHONHASHSEED; engines sharing blocks need the same "
                        f"(default: $PYTHONHASHSEED, else {DEFAULT_SEED!r}, as vLLM)")
    p.add_argument("--hash-algo", default="sha256_cbor", choices=["sha256_cbor", "xxh3_128_cbor"],
                   help="block-hash function (sha256_cbor is vLLM's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached blocks")
    p.add_argument("--no-prefix-hold", action="store_true",
                   help="match a queued request's cached prefix only at its admission (by default its "
                        "blocks are held from its arrival, so other requests cannot evict them meanwhile)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (by default small steps replay CUDA graphs)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA graphs, no offload: launch each greedy decode step before the last step's "
                        "tokens are read, overlapping the host's work with the GPU's (on by default; --no-async-scheduling "
                        "steps synchronously)")
    p.add_argument("--engine-id", default=None,
                   help="this engine's source name in the event log and at offloadd, unique among "
                        "live engines (default: HOSTNAME-PID)")


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    cfg = EngineConfig(
        model_dir=a.model, device=a.device, dtype=a.dtype, block_size=a.block_size,
        num_gpu_blocks=a.num_gpu_blocks, max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, hash_seed=a.hash_seed,
        hash_algo=a.hash_algo, enable_prefix_caching=not a.no_prefix_caching,
        hold_prefix_on_arrival=not a.no_prefix_hold, engine_id=a.engine_id or default_engine_id(),
        enforce_eager=a.enforce_eager, async_scheduling=a.async_scheduling,
    )
    cfg.validate()
    return cfg


def _security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (see SECURITY.md); secrets come from files, never flag values")
    g.add_argument("--tls-cert", default="", metavar="PEM", help="serve Generate over TLS with this certificate chain")
    g.add_argument("--tls-key", default="", metavar="PEM", help="the private key of --tls-cert")
    g.add_argument("--tls-client-ca", default="", metavar="PEM",
                   help="mutual TLS: clients must present a certificate signed by this CA")
    g.add_argument("--auth-token-file", default=os.environ.get("KV_ENGINE_AUTH_TOKEN_FILE", ""), metavar="FILE",
                   help="Generate callers must send 'authorization: Bearer <token in FILE>' (env KV_ENGINE_AUTH_TOKEN_FILE)")
    g.add_argument("--offloadd-ca", default="", metavar="PEM", help="reach offloadd over TLS, trusting this CA")
    g.add_argument("--offloadd-cert", default="", metavar="PEM", help="client certificate for offloadd (mutual TLS)")
    g.add_argument("--offloadd-key", default="", metavar="PEM", help="the private key of --offloadd-cert")
    g.add_argument("--offloadd-token-file", default=os.environ.get("KVD_AUTH_TOKEN_FILE", ""), metavar="FILE",
                   help="bearer token for offloadd (env KVD_AUTH_TOKEN_FILE, the daemon's own setting)")


def _parser() -> argparse.ArgumentParser:
    example = ("example: kv-engine make-tiny-model /tmp/tiny && kv-engine serve --model /tmp/tiny "
               "--port 50061 --http-port 8001 --offloadd 127.0.0.1:50051 --offload")
    parser = argparse.ArgumentParser(prog="kv-engine", description=__doc__, epilog=example)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the gRPC Generate API", epilog=example)
    _engine_args(serve)
    serve.add_argument("--host", default="[::]", help="interface of the Generate gRPC server")
    serve.add_argument("--port", type=int, default=50061, help="port of the Generate gRPC server")
    serve.add_argument("--offloadd", default=None, metavar="HOST:PORT",
                       help="publish KV events to this offloadd (EventIngest); none: events stay local")
    serve.add_argument("--max-unacked-batches", type=int, default=1024,
                       help="event batches kept for resending while offloadd is away")
    serve.add_argument("--metrics-port", type=int, default=-1, help="Prometheus port (-1: off, 0: any)")
    serve.add_argument("--http-port", type=int, default=-1,
                       help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                            "/v1/models, /health) on this port (-1: off, 0: any)")
    serve.add_argument("--http-host", default=None, help="interface of the HTTP API (default: --host)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name the HTTP API answers to (default: the model directory's name)")
    serve.add_argument("--offload", action="store_true",
                       help="use offloadd's host tier (store full blocks, load CPU-tier prefixes); needs --offloadd")
    serve.add_argument("--model-namespace", default=None,
                       help="host-tier namespace shared by engines of the same weights (default: model dir name)")
    serve.add_argument("--shutdown-grace-s", type=float, default=5.0, metavar="S",
                       help="on SIGTERM/SIGINT, requests in flight get this long to finish, then end with an "
                            "error (gRPC UNAVAILABLE, HTTP 503); queued offload stores and KV event acks "
                            "are waited for after them (a second signal exits at once)")
    _security_args(serve)
    gen = sub.add_parser("generate", help="generate for one prompt and print the text")
    _engine_args(gen)
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--token-ids", default=None, help="comma-separated token ids instead of --prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--show-events", action="store_true", help="print the KV events as well")
    tiny = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--hybrid", action="store_true", help="alternate full and sliding-window layers")
    d = TinyModelSpec()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_position_embeddings", "sliding_window", "num_shards", "seed"):
        tiny.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    tiny.add_argument("--layers", type=int, dest="num_layers", help="alias of --num-layers")
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    return parser


def _make_tiny(a: argparse.Namespace) -> int:
    spec = TinyModelSpec(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
        max_position_embeddings=a.max_position_embeddings, hybrid=a.hybrid, sliding_window=a.sliding_window,
        tie_word_embeddings=a.tie_word_embeddings, num_shards=a.num_shards, seed=a.seed,
    )
    sizes = {k: getattr(spec, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                           "num_layers", "num_heads", "num_kv_heads",
                                           "max_position_embeddings", "num_shards")}
    if bad := [f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if v < 1]:
        raise ValueError(f"sizes must be >= 1: {', '.join(bad)}")
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads; num_shards >= 1")
    print(write_tiny_model(a.dir, spec))
    return 0


def _generate(a: argparse.Namespace) -> int:
    from engine.event_sink import RecordingEventSink
    from engine.llm import LLM

    if (a.prompt is None) == (a.token_ids is None):
        raise ValueError("give exactly one of --prompt and --token-ids")
    prompt: str | list[int] = a.prompt if a.prompt is not None else [int(t) for t in a.token_ids.split(",") if t.strip()]
    sink = RecordingEventSink()
    llm = LLM.from_config(_engine_config(a), event_sink=sink)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            seed=a.seed, ignore_eos=a.ignore_eos)
    out = llm.generate([prompt], params)[0].outputs[0]
    print(out.text)
    print(f"token_ids={out.token_ids} finish_reason={out.finish_reason}", file=sys.stderr)
    if a.show_events:
        for e in sink.events:
            print(e, file=sys.stderr)
    return 0


def _serve(a: argparse.Namespace) -> int:
    from rpc.targets import check_grpc_target
    from rpc.tls import ClientSecurity, check_server_tls, read_token, server_credentials

    # Numbers first: a port past 65535 was an OverflowError traceback from the metrics server,
    # after the model had loaded and Generate was serving.
    for flag, port, lowest in (("--port", a.port, 0), ("--metrics-port", a.metrics_port, -1),
                               ("--http-port", a.http_port, -1)):
        if not lowest <= port <= 65535:
            raise ValueError(f"{flag} must be in {lowest}..65535, got {port}")
    if not 0 <= a.shutdown_grace_s < math.inf:
        raise ValueError(f"--shutdown-grace-s must be >= 0 and finite, got {a.shutdown_grace_s}")
    if a.offloadd:  # a typo would be retried forever as an offloadd that is down
        check_grpc_target(a.offloadd, "--offloadd")
    # Files first: a bad one is refused before the model and torch load.
    check_server_tls(a.tls_cert, a.tls_key, a.tls_client_ca)
    server_creds = server_credentials(a.tls_cert, a.tls_key, a.tls_client_ca) if a.tls_cert else None
    token = read_token(a.auth_token_file) if a.auth_token_file else None
    to_offloadd = ClientSecurity.from_files(a.offloadd_ca, a.offloadd_cert, a.offloadd_key, a.offloadd_token_file)

    from engine.engine_core import EngineCore
    from engine.engine_loop import EngineLoop
    from engine.server import create_server
    from engine.shutdown import SERVER_MARGIN_S, Serving

    cfg = _engine_config(a)
    sink = None
    if a.offloadd:
        from engine.ingest_sink import IngestEventSink

        if a.max_unacked_batches < 1:
            raise ValueError(f"--max-unacked-batches must be >= 1, got {a.max_unacked_batches}")
        sink = IngestEventSink(a.offloadd, cfg.engine_id, max_pending=a.max_unacked_batches,
                               security=to_offloadd)
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    connector = None
    if a.offload:
        from engine.offload.config import OffloadConnectorConfig
        from engine.offload.connector import OffloadingConnector

        if not a.offloadd:
            raise ValueError("--offload needs --offloadd HOST:PORT")
        from offloadd.client import OffloadClient, RetryPolicy

        namespace = a.model_namespace or Path(cfg.model_dir).resolve().name
        conn_cfg = OffloadConnectorConfig(a.offloadd, cfg.engine_id, namespace)
        # Built here rather than by the connector, which knows no credentials: same settings.
        client = OffloadClient(conn_cfg.target, timeout_s=conn_cfg.timeout_s, retry=RetryPolicy(attempts=2),
                               credentials=to_offloadd.credentials, token=to_offloadd.token)
        connector = OffloadingConnector(conn_cfg, client=client, registry=registry)
    core = EngineCore(cfg, event_sink=sink, connector=connector)
    loop = EngineLoop(core).start()
    server, port = create_server(loop, f"{a.host}:{a.port}", credentials=server_creds, token=token)
    server.start()
    log.info("serving Generate on port %d (model %s, device %s, engine_id %s)", port, cfg.model_dir, cfg.device, cfg.engine_id)
    print(f"kv-engine: serving on port {port}", flush=True)
    http = None
    if a.http_port >= 0:
        from engine.http_api import create_app
        from events.prompt import load_chat_template
        from rpc.http_server import ThreadedHttpServer

        model_name = a.served_model_name or Path(cfg.model_dir).resolve().name
        app = create_app(loop, model_name, load_chat_template(cfg.model_dir))
        http = ThreadedHttpServer(app, a.http_host or a.host, a.http_port,
                                 grace_s=a.shutdown_grace_s + SERVER_MARGIN_S).start()
        log.info("OpenAI HTTP API on port %d (model name %r)", http.port, model_name)
        print(f"kv-engine: http on port {http.port}", flush=True)
    if a.metrics_port >= 0:
        from engine.metrics import EngineCollector

        registry.register(EngineCollector(loop, sink))
        metrics_server, _thread = start_http_server(a.metrics_port, registry=registry)
        log.info("metrics on port %d", metrics_server.server_port)
        print(f"kv-engine: metrics on port {metrics_server.server_port}", flush=True)
    _wait_for_stop_signal()
    log.info("shutting down (requests in flight get %.1f s)", a.shutdown_grace_s)
    Serving(loop, server, http, connector, core.event_sink).shut_down(a.shutdown_grace_s)
    return 0


def _wait_for_stop_signal() -> None:
    """Until the first SIGTERM or SIGINT; a second one ends the process at once (default action)."""
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    done.wait()


def main(argv: Sequence[str] | None = None) -> int:
    if _missing is not None:
        print(f"kv-engine: needs the engine extra (no module {_missing!r}): "
              "pip install 'kvoffload[engine]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        if args.command == "make-tiny-model":
            return _make_tiny(args)
        if args.command == "generate":
            return _generate(args)
        return _serve(args)
    except (ValueError, ModelConfigError, EngineError, OSError) as exc:
        print(f"kv-engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
