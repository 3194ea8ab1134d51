"""kv-bridge configuration: one frozen dataclass built from flags and KVB_* / REDIS_URL env."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from bridge.errors import BridgeConfigError
from events.logkeys import LogKeys
from rpc import redis_connect
from rpc.logs import LOG_LEVELS, log_level

Layout = Literal["map", "legacy"]
StartAt = Literal["resume", "head", "beginning"]


@dataclass(frozen=True)
class BridgeConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "default"
    """Deployment namespace of the log (``kvd:{namespace}:``)."""
    name: str = "kv-bridge"
    """Names this bridge's saved position in Redis; two bridges on one log need two names."""
    pub_endpoint: str = "tcp://*:5557"
    replay_endpoint: str = "tcp://*:5558"
    topic: str = "kv-events"
    """Topic of the mixed stream, the single-source stream, or a template with ``{source}``.
    vLLM's publishers use ``""``; our subscriber follows both by default."""
    layout: Layout = "map"
    legacy_pub_endpoint: str | None = None
    """A second PUB for the same streams in the legacy array layout (bridge.legacy_mirror)."""
    legacy_replay_endpoint: str | None = None
    """Its ROUTER: replay and snapshots in the legacy layout."""
    source: str | None = None
    """Publish only this engine's records, numbered from 0 on their own."""
    per_source: bool = False
    """Publish every source on its own topic (``topic`` must contain ``{source}``)."""
    default_source: str | None = None
    """Per-source mode: whose stream a request without a topic frame (vLLM's) replays."""
    start: StartAt = "resume"
    """Where a bridge with no saved position starts publishing: at the head or from offset 1."""
    hwm: int = 100_000
    """ZMQ send high-water mark (messages) of the PUB and ROUTER sockets."""
    metrics_port: int = 9401
    """Port of ``/metrics`` and ``/healthz`` (0 = any free port, logged at start)."""
    metrics_host: str = "0.0.0.0"
    poll_block_ms: int = 50
    read_chunk: int = 500
    replay_chunk: int = 256
    save_interval_s: float = 0.2
    epoch_check_s: float = 1.0
    """How often an idle bridge checks the log's epoch (after every read anyway)."""
    replay_send_timeout_s: float = 10.0
    max_pending: int = 20_000
    """Published records whose apply to the state may wait for idle time (bridge.state)."""
    full_gc_interval_s: float = 600.0
    """How often the bridge runs a full garbage collection (see Bridge._collect_garbage)."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        try:
            LogKeys(self.namespace)  # validates the namespace
            redis_connect.parse(self.redis_url)
        except ValueError as exc:
            raise BridgeConfigError(str(exc)) from None
        if self.layout not in ("map", "legacy"):
            raise BridgeConfigError(f"layout must be 'map' or 'legacy', got {self.layout!r}")
        if self.start not in ("resume", "head", "beginning"):
            raise BridgeConfigError(f"start must be resume, head or beginning, got {self.start!r}")
        if self.per_source and self.source is not None:
            raise BridgeConfigError("choose either --source or --per-source, not both")
        if self.per_source and "{source}" not in self.topic:
            raise BridgeConfigError(f"--per-source needs a topic template with {{source}}, got {self.topic!r}")
        if not self.per_source and "{source}" in self.topic:
            raise BridgeConfigError("a topic with {source} needs --per-source")
        if self.default_source is not None and not self.per_source:
            raise BridgeConfigError("--default-source is for --per-source mode")
        if (self.legacy_pub_endpoint is None) != (self.legacy_replay_endpoint is None):
            raise BridgeConfigError("give both --legacy-pub and --legacy-replay, or neither")
        if self.legacy_pub_endpoint is not None and self.layout == "legacy":
            raise BridgeConfigError("--legacy-pub adds the legacy layout to a map-layout bridge; "
                                    "this one already publishes the legacy layout")
        for flag, value in (("--hwm", self.hwm), ("--metrics-port", self.metrics_port),
                            ("--max-pending", self.max_pending)):
            if value < 0:
                raise BridgeConfigError(f"{flag} must be >= 0, got {value}")
        if self.metrics_port > 65535:
            raise BridgeConfigError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.read_chunk < 1 or self.replay_chunk < 1:
            raise BridgeConfigError("chunk sizes must be >= 1")

    @property
    def keys(self) -> LogKeys:
        return LogKeys(self.namespace)

    def topic_for(self, source: str | None) -> str:
        return self.topic.format(source=source) if self.per_source else self.topic


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    d = BridgeConfig()

    def e(name: str, default: object) -> object:
        return env.get(f"KVB_{name}", default)

    def n(name: str, default: int) -> int:
        raw = e(name, default)
        try:
            return int(str(raw))
        except ValueError:
            raise BridgeConfigError(f"KVB_{name}={raw!r} is not an integer") from None

    p = argparse.ArgumentParser(
        prog="kv-bridge",
        description="Republish the kvoffload log in the vLLM KV-event ZMQ wire format: live batches "
        "on a PUB socket, any retained seq and full-state snapshots on a ROUTER socket. Options "
        "can also be set as KVB_<NAME> in the environment (the Redis URL as REDIS_URL).",
        epilog="example: kv-bridge --redis-url redis://127.0.0.1:6379/0 --namespace node-a "
        "--pub tcp://*:5557 --replay tcp://*:5558; then watch it with kvctl tail --pub "
        "tcp://HOST:5557 --replay tcp://HOST:5558",
    )
    p.add_argument("--redis-url", default=env.get("REDIS_URL", d.redis_url),
                   help="Redis holding the log (credentials go in the URL; env REDIS_URL): "
                   "redis://host:port/db, a Cluster's seed nodes redis+cluster://host:port,host:port "
                   "or Sentinel's redis+sentinel://host:port/service")
    p.add_argument("--namespace", default=e("NAMESPACE", d.namespace),
                   help="deployment namespace: the daemon's key prefix kvd:{namespace}:")
    p.add_argument("--name", default=e("NAME", d.name), help="names the saved seq position")
    p.add_argument("--pub", dest="pub_endpoint", default=e("PUB", d.pub_endpoint),
                   help="ZMQ PUB endpoint to bind for live batches")
    p.add_argument("--replay", dest="replay_endpoint", default=e("REPLAY", d.replay_endpoint),
                   help="ZMQ ROUTER endpoint to bind for replay and snapshot requests")
    p.add_argument("--topic", default=e("TOPIC", d.topic),
                   help="topic frame of every message; default kv-events (vLLM's publishers use "
                        "'', which vLLM consumers subscribe to by default: pass --topic '' for them)")
    p.add_argument("--layout", choices=["map", "legacy"], default=e("LAYOUT", d.layout),
                   help="event encoding: map (vLLM >= 0.24) or legacy arrays (older consumers)")
    p.add_argument("--legacy-pub", dest="legacy_pub_endpoint", default=e("LEGACY_PUB", None),
                   help="also publish the same streams in the legacy array layout on this PUB "
                        "endpoint (for vLLM's example subscriber); needs --legacy-replay")
    p.add_argument("--legacy-replay", dest="legacy_replay_endpoint",
                   default=e("LEGACY_REPLAY", None),
                   help="ROUTER endpoint for replay and snapshots in the legacy layout")
    p.add_argument("--source", default=e("SOURCE", d.source), help="publish only this engine")
    p.add_argument(
        "--per-source", action="store_true",
        default=str(e("PER_SOURCE", "")).lower() in ("1", "true", "yes"),
        help="one topic per source; --topic must contain {source}",
    )
    p.add_argument("--default-source", default=e("DEFAULT_SOURCE", None),
                   help="--per-source: the source whose stream answers a replay request without "
                        "a topic frame (vLLM's clients); without it such a request gets an error "
                        "end marker")
    p.add_argument("--start", choices=["resume", "head", "beginning"], default=e("START", d.start),
                   help="where publishing starts: the saved position, the log's head, or offset 1")
    p.add_argument("--hwm", type=int, default=n("HWM", d.hwm),
                   help="PUB send high-water mark (messages queued per slow subscriber)")
    p.add_argument("--metrics-port", type=int, default=n("METRICS_PORT", d.metrics_port),
                   help="port of /metrics and /healthz (0: any free port)")
    p.add_argument("--metrics-host", default=e("METRICS_HOST", d.metrics_host))
    p.add_argument("--max-pending", type=int, default=n("MAX_PENDING", d.max_pending),
                   help="records published before their apply to the state must catch up")
    p.add_argument("--log-level", type=log_level, default=e("LOG_LEVEL", d.log_level),
                   help=f"one of {', '.join(LOG_LEVELS)}")
    return p


def config_from_args(argv: Sequence[str], env: Mapping[str, str]) -> BridgeConfig:
    """Build the config; argparse exits 2 with a message on bad flags; BridgeConfigError (or
    ValueError from a numeric KVB_* value) on bad values."""
    a = _parser(env).parse_args(list(argv))
    return BridgeConfig(
        redis_url=a.redis_url, namespace=a.namespace, name=a.name, pub_endpoint=a.pub_endpoint,
        replay_endpoint=a.replay_endpoint, topic=a.topic, layout=a.layout, source=a.source or None,
        per_source=a.per_source, default_source=a.default_source or None,
        legacy_pub_endpoint=a.legacy_pub_endpoint or None,
        legacy_replay_endpoint=a.legacy_replay_endpoint or None, start=a.start, hwm=a.hwm, metrics_port=a.metrics_port,
        metrics_host=a.metrics_host, max_pending=a.max_pending,
        log_level=str(a.log_level).upper(),
    )
