"""kv-ingest configuration: one frozen dataclass built from flags, a config file and KVI_* env.

A vLLM publisher is named on the command line as
``NAME=tcp://host:pub_port[,replay=tcp://host:port][,topic=T][,dp=N]`` (repeatable) or in a TOML
file (``[[vllm]]`` tables with the keys ``name``, ``pub``, ``replay``, ``topic``, ``dp``).
``dp=N`` follows N data-parallel ranks the way vLLM binds them: rank r publishes on the pub and
replay ports plus r. Each rank is its own source: ``NAME`` for rank 0, ``NAME-dp<r>`` for r > 0.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest.errors import IngestConfigError
from rpc.logs import LOG_LEVELS, log_level
from rpc.targets import TargetError, check_grpc_target

MAX_DP = 256


@dataclass(frozen=True)
class VllmSource:
    """One vLLM publisher (one data-parallel rank) that kv-ingest follows."""

    name: str
    """The source name in the log for rank ``dp_rank`` (see :func:`source_name`)."""
    pub: str
    """The engine's PUB endpoint, e.g. ``tcp://10.0.0.7:5557``."""
    replay: str | None = None
    """Its replay ROUTER endpoint; None: gaps are re-synced without a replay."""
    topic: str = ""
    """The topic frame its messages carry (vLLM's default is empty)."""
    dp_rank: int = 0


def source_name(name: str, dp_rank: int) -> str:
    """The log's source for a publisher's rank: ``NAME`` for rank 0, ``NAME-dp<r>`` else."""
    return name if dp_rank == 0 else f"{name}-dp{dp_rank}"


@dataclass(frozen=True)
class IngestConfig:
    sources: tuple[VllmSource, ...]
    offloadd: str = "127.0.0.1:50051"
    """offloadd's gRPC target (host:port or unix:PATH)."""
    offloadd_ca_file: str | None = None
    """CA bundle to reach a TLS offloadd; None: plaintext."""
    offloadd_token_file: str | None = None
    """File holding offloadd's bearer token; None: no token."""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9404
    """Port of ``/metrics`` and ``/healthz`` (0 = any free port, logged at start)."""
    replay_timeout_s: float = 2.0
    """How long a replay request may take before the publisher counts as unreachable."""
    idle_sync_s: float = 2.0
    """After this long without a batch, ask the replay socket whether one was missed (a lost
    last batch, or a publisher that restarted quietly)."""
    publisher_lease_s: float = 30.0
    """A publisher unreachable this long is taken for gone: its sources are cleared."""
    max_pending: int = 4096
    """Batches sent to offloadd and not yet acked, per source, before reading waits."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.sources:
            raise IngestConfigError("no vLLM publisher given: use --vllm NAME=tcp://HOST:PORT or --config FILE")
        names = [source_name(s.name, s.dp_rank) for s in self.sources]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise IngestConfigError(f"source names must be unique, repeated: {', '.join(sorted(dup))}")
        for flag, seconds in (("--replay-timeout-s", self.replay_timeout_s), ("--idle-sync-s", self.idle_sync_s),
                              ("--publisher-lease-s", self.publisher_lease_s)):
            if not seconds > 0:  # NaN too
                raise IngestConfigError(f"{flag} must be > 0, got {seconds}")
        if self.max_pending < 1:
            raise IngestConfigError(f"--max-pending must be >= 1, got {self.max_pending}")
        if not 0 <= self.metrics_port <= 65535:
            raise IngestConfigError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        try:
            check_grpc_target(self.offloadd, "--offloadd")
        except TargetError as exc:
            raise IngestConfigError(str(exc)) from None


def _check_endpoint(value: str, what: str) -> str:
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise IngestConfigError(f"{what} must be a ZMQ endpoint like tcp://host:5557, got {value!r}")
    return value


def _offset_port(endpoint: str, rank: int) -> str:
    """vLLM's rule for a DP rank's endpoint: the tcp port plus the rank."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    try:
        return f"{base}:{int(port) + rank}"
    except ValueError:
        raise IngestConfigError(f"endpoint {endpoint!r} has no numeric port") from None


def expand(name: str, pub: str, replay: str | None, topic: str, dp: int) -> list[VllmSource]:
    """One VllmSource per DP rank, endpoints offset as vLLM offsets them."""
    if not name or any(c in name for c in "=, \t"):
        raise IngestConfigError(f"bad publisher name {name!r}: no '=', ',' or spaces")
    if not 1 <= dp <= MAX_DP:
        raise IngestConfigError(f"{name}: dp must be in [1, {MAX_DP}], got {dp}")
    _check_endpoint(pub, f"{name}: pub")
    if replay is not None:
        _check_endpoint(replay, f"{name}: replay")
    return [
        VllmSource(name, _offset_port(pub, r), None if replay is None else _offset_port(replay, r),
                   topic, r)
        for r in range(dp)
    ]


def parse_spec(spec: str) -> list[VllmSource]:
    """``NAME=tcp://host:port[,replay=...][,topic=T][,dp=N]`` -> one VllmSource per rank."""
    name, eq, rest = spec.partition("=")
    if not eq or not rest:
        raise IngestConfigError(f"--vllm {spec!r}: expected NAME=tcp://HOST:PORT[,replay=...][,topic=T][,dp=N]")
    pub, *options = rest.split(",")
    values: dict[str, str] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key not in ("replay", "topic", "dp") or key in values:
            raise IngestConfigError(f"--vllm {spec!r}: unknown or repeated option {option!r} "
                                    "(replay=, topic=, dp=)")
        values[key] = value
    try:
        dp = int(values.get("dp", "1"))
    except ValueError:
        raise IngestConfigError(f"--vllm {spec!r}: dp must be an integer") from None
    return expand(name, pub, values.get("replay"), values.get("topic", ""), dp)


def load_file(path: str) -> list[VllmSource]:
    """``[[vllm]]`` tables of a TOML file."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise IngestConfigError(f"config file {path}: {exc}") from None
    tables = data.get("vllm", [])
    if not isinstance(tables, list):
        raise IngestConfigError(f"config file {path}: 'vllm' must be an array of tables ([[vllm]])")
    out: list[VllmSource] = []
    for i, t in enumerate(tables):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("pub"), str):
            raise IngestConfigError(f"config file {path}: vllm[{i}] needs string keys name and pub")
        unknown = set(t) - {"name", "pub", "replay", "topic", "dp"}
        if unknown:
            raise IngestConfigError(f"config file {path}: vllm[{i}]: unknown keys {sorted(unknown)}")
        replay, topic, dp = t.get("replay"), t.get("topic", ""), t.get("dp", 1)
        if not isinstance(replay, str | None) or not isinstance(topic, str) or type(dp) is not int:
            raise IngestConfigError(f"config file {path}: vllm[{i}]: replay and topic are strings, dp an int")
        out.extend(expand(t["name"], t["pub"], replay, topic, dp))
    return out


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    d = IngestConfig.__dataclass_fields__

    def e(name: str, key: str) -> Any:
        return env.get(f"KVI_{name}", d[key].default)

    def n(name: str, key: str, conv: type[int] | type[float]) -> Any:
        raw = e(name, key)
        try:
            return conv(raw)
        except ValueError:
            kind = "an integer" if conv is int else "a number"
            raise IngestConfigError(f"KVI_{name}={raw!r} is not {kind}") from None

    p = argparse.ArgumentParser(
        prog="kv-ingest",
        description="Follow vLLM engines' ZMQ KV-event publishers and append their batches to "
        "offloadd's durable log (EventIngest), one source per engine and data-parallel rank, so "
        "routers can subscribe to kv-bridge (replay from any seq, snapshots) instead of to each "
        "engine. Gaps are filled from the engine's replay socket; what its ring no longer holds, "
        "and an engine restart, re-sync the source (cleared, then rebuilt from the ring and what "
        "follows). Options can also be set as KVI_<NAME> in the environment.",
        epilog="example: kv-ingest --offloadd 127.0.0.1:50051 "
        "--vllm pod-a=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558 "
        "--vllm pod-b=tcp://10.0.0.8:5557,replay=tcp://10.0.0.8:5558,dp=2",
    )
    p.add_argument("--vllm", action="append", default=[], metavar="SPEC",
                   help="NAME=tcp://HOST:PUB_PORT[,replay=tcp://HOST:PORT][,topic=T][,dp=N] "
                   "(repeatable; env KVI_VLLM: several separated by ';')")
    p.add_argument("--config", default=env.get("KVI_CONFIG"), metavar="FILE",
                   help="TOML file with [[vllm]] tables (name, pub, replay, topic, dp)")
    p.add_argument("--offloadd", default=e("OFFLOADD", "offloadd"),
                   help="offloadd's gRPC target (default %(default)s)")
    p.add_argument("--offloadd-ca", default=e("OFFLOADD_CA", "offloadd_ca_file"),
                   help="CA bundle of a TLS offloadd")
    p.add_argument("--offloadd-token-file", default=e("OFFLOADD_TOKEN_FILE", "offloadd_token_file"),
                   help="file holding offloadd's bearer token")
    p.add_argument("--metrics-host", default=e("METRICS_HOST", "metrics_host"))
    p.add_argument("--metrics-port", type=int, default=n("METRICS_PORT", "metrics_port", int),
                   help="port of /metrics and /healthz (0: any free port; default %(default)s)")
    p.add_argument("--replay-timeout-s", type=float,
                   default=n("REPLAY_TIMEOUT_S", "replay_timeout_s", float),
                   help="how long a replay request may take (default %(default)s)")
    p.add_argument("--idle-sync-s", type=float, default=n("IDLE_SYNC_S", "idle_sync_s", float),
                   help="check the replay socket after this long without a batch (default %(default)s)")
    p.add_argument("--publisher-lease-s", type=float,
                   default=n("PUBLISHER_LEASE_S", "publisher_lease_s", float),
                   help="clear a publisher's sources after this long unreachable (default %(default)s)")
    p.add_argument("--max-pending", type=int, default=n("MAX_PENDING", "max_pending", int),
                   help="unacked batches per source before reading waits (default %(default)s)")
    p.add_argument("--log-level", type=log_level, default=e("LOG_LEVEL", "log_level"),
                   help=f"one of {', '.join(LOG_LEVELS)}")
    return p


def config_from_args(argv: Sequence[str], env: Mapping[str, str]) -> IngestConfig:
    """Build the config; argparse exits 2 on bad flags; IngestConfigError (a ValueError) on bad
    values."""
    try:
        a = _parser(env).parse_args(list(argv))
    except ValueError as exc:  # a non-numeric KVI_* default
        raise IngestConfigError(f"bad environment value: {exc}") from None
    specs = list(a.vllm) or [s for s in env.get("KVI_VLLM", "").split(";") if s.strip()]
    sources = [s for spec in specs for s in parse_spec(spec.strip())]
    if a.config:
        sources.extend(load_file(a.config))
    return IngestConfig(
        sources=tuple(sources), offloadd=a.offloadd, offloadd_ca_file=a.offloadd_ca or None,
        offloadd_token_file=a.offloadd_token_file or None, metrics_host=a.metrics_host,
        metrics_port=a.metrics_port, replay_timeout_s=a.replay_timeout_s,
        idle_sync_s=a.idle_sync_s, publisher_lease_s=a.publisher_lease_s,
        max_pending=a.max_pending, log_level=str(a.log_level).upper(),
    )
