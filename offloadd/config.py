"""The daemon's one frozen configuration, built once at the entry point from flags and environment.

Every field can be given as a flag (``--capacity-bytes``) or as ``KVD_<FIELD>`` in the
environment (``KVD_CAPACITY_BYTES``); flags win. ``REDIS_URL`` is honoured as a fallback for
``redis_url``. Nothing below the entry point reads ``os.environ``.

Secrets never travel as flag values (other users of the node can read a process's arguments):
the bearer token is read from ``auth_token_file``; the Redis password belongs in ``REDIS_URL``
or ``KVD_REDIS_URL`` in the environment rather than in ``--redis-url``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import grp
import inspect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from events.hashing import DIGEST_BYTES, HASH_ALGOS, HashAlgo
from events.logkeys import LogKeys
from offloadd.client.batch_split import DAEMON_MAX_MESSAGE_BYTES
from offloadd.errors import OffloaddError
from offloadd.fleet.peers import parse_peers
from rpc import redis_connect
from rpc.logs import LOG_LEVELS
from rpc.tls import SecurityConfigError, check_server_tls

Eviction = Literal["lru", "arc"]
EVICTIONS: Final[tuple[Eviction, ...]] = ("lru", "arc")
MiB: Final[int] = 1 << 20
GiB: Final[int] = 1 << 30
DEFAULT_MAX_ID_BYTES: Final[int] = 256


class ConfigError(OffloaddError, ValueError):
    """A flag or environment value is invalid; the message names it."""


@dataclass(frozen=True)
class OffloaddConfig:
    grpc_host: str = "[::]"
    """Interface for the TCP gRPC listener."""
    grpc_port: int = 50051
    """TCP port; 0 picks a free one (logged at start)."""
    unix_socket: str = ""
    """Path of an extra unix-socket listener (plaintext; guarded by its file mode); empty = none."""
    unix_socket_mode: int = 0o600
    """Permission bits of the unix socket: who may connect (write permission is needed)."""
    unix_socket_group: str = ""
    """Group of the unix socket (use with unix_socket_mode 0o660); empty = the daemon's."""
    tls_cert_file: str = ""
    """PEM certificate chain of the TCP listener; with tls_key_file it turns TLS on."""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file."""
    tls_client_ca_file: str = ""
    """PEM CA bundle; set = mutual TLS: every TCP client must present a certificate it signed."""
    auth_token_file: str = ""
    """File holding the bearer token every call (but health) must carry; empty = no token."""
    metrics_host: str = "0.0.0.0"
    """Interface for the Prometheus /metrics listener."""
    metrics_port: int = 9400
    """Prometheus /metrics port; 0 picks a free one, -1 disables it."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis deployment: redis://host:port/db, rediss://..., unix:///path, a Cluster's seed
    nodes redis+cluster://host:port[,host:port...], or Sentinel's
    redis+sentinel://host:port[,host:port...]/service (rpc.redis_connect)."""
    redis_wait_replicas: int = 0
    """Acknowledge a log write only once this many replicas have it (Redis WAIT after each
    write); 0 = once the primary has it, so a failover may lose the newest writes: the daemon
    then ends the log and a new epoch starts (DECISIONS 40)."""
    redis_wait_timeout_ms: int = 1000
    """How long a write waits for those replicas; past it the write is in doubt (UNAVAILABLE)."""
    redis_timeout_s: float = 2.0
    """Socket timeout for every Redis call; past it the call is refused with UNAVAILABLE."""
    namespace: str = "default"
    """Deployment namespace: the Redis key prefix kvd:{namespace}: and the arena file names."""
    arena_dir: str = "/dev/shm"
    """Directory of the arena files (shared memory engines map: a tmpfs such as /dev/shm) and
    of the daemon's arena marker."""
    capacity_bytes: int = 1 * GiB
    """Total bytes of arena files the daemon may create, over all layouts."""
    chunk_bytes: int = 256 * MiB
    """Size of one arena file; clamped to capacity_bytes."""
    file_mode: int = 0o600
    """Permission bits of the arena files; 0o660 with file_group lets engines of that group map them."""
    file_group: str = ""
    """Group name for the arena files (use with file_mode 0o660); empty = the daemon's."""
    lease_ms: int = 30_000
    """Default lifetime of pins (Lookup) and reservations (Reserve)."""
    max_lease_ms: int = 600_000
    """Longest lifetime a Lookup or Reserve may ask for; longer requests are cut to it."""
    sweep_interval_ms: int = 100
    """How often expired leases and reservations are swept."""
    eviction: Eviction = "lru"
    """Which blocks a full tier drops first: lru or arc."""
    verify_on_load: bool = False
    """Check a block's xxh3 checksum on every Lookup hit (a mismatch is a miss and is dropped)."""
    max_batch_events: int = 4096
    """Most events in one EventBatch; a larger batch is refused with a message naming the limit."""
    max_message_bytes: int = DAEMON_MAX_MESSAGE_BYTES
    """Largest gRPC message received (an EventBatch, a request); a larger one fails its call with
    RESOURCE_EXHAUSTED. IngestStream splits batches far below it (DECISIONS 45)."""
    max_request_hashes: int = 16_384
    """Largest number of hashes or blocks accepted in one OffloadStore request."""
    min_block_bytes: int = 256
    """Smallest block a layout may register: each slot costs 8 bytes of slot table besides it."""
    max_layouts: int = 64
    """Most layouts the daemon holds; a registration that needs more is RESOURCE_EXHAUSTED."""
    max_engines: int = 1024
    """Most engine ids registered at once; a new one past it is RESOURCE_EXHAUSTED."""
    max_id_bytes: int = DEFAULT_MAX_ID_BYTES
    """Longest engine id, model namespace, dtype or layout name (UTF-8 bytes) accepted."""
    hash_algo: HashAlgo = "sha256_cbor"
    """Block hash of this namespace (sha256_cbor or xxh3_128_cbor); engines must hash with the
    same one (RegisterEngine answers it)."""
    grace_s: float = 5.0
    """SIGTERM: seconds in-flight unary RPCs get before the server stops (streams end first)."""
    engine_lease_s: float = 10.0
    """An engine whose Publish stream broke (crash) keeps its GPU tier this long without one;
    then it is cleared (AllBlocksCleared). A stream closed cleanly clears it at once."""
    log_level: str = "INFO"
    """DEBUG, INFO, WARNING, ERROR or CRITICAL (any case); logs are JSON lines on stderr."""
    owner_lease_s: float = 5.0
    """Lifetime of the namespace's owner lease (renewed every third of it). A second daemon on
    the namespace is refused while it is held; a daemon paused past it loses the namespace."""
    checkpoint_interval_s: float = 60.0
    """A checkpoint of the reduced state is written this often when records were appended
    since the last one (offloadd.log.checkpoint); recovery replays only the log after it."""
    checkpoint_records: int = 10_000
    """... and as soon as this many records were appended since the last checkpoint: it bounds
    the tail a restart replays (DECISIONS 48, 75)."""
    checkpoint_fork_blocks: int = 250_000
    """A checkpoint cuts only what changed since the previous one when a tier only grew, else
    the whole tier; up to this many blocks to cut, it cuts them in the event loop in ~1 ms
    slices (~1 us of CPU each), more in a forked child (a fork stalls the loop ~15 ms at 1M
    blocks resident). 0: always fork."""
    full_gc_interval_s: float = 600.0
    """What is alive leaves the garbage collector's view four times a second (gc.freeze: no
    pauses that walk the whole state); a full collection, a pause of that size, runs this often
    to free the cyclic garbage the freezes kept."""
    retention_records: int = 1_000_000
    """Keep at least the newest this many log records (0 = no floor by count)."""
    retention_s: float = 86_400.0
    """Keep at least the records of the last this many seconds (0 = no floor by age)."""
    retention_bytes: int = 0
    """Keep at least about this many bytes of the newest records (0 = no floor by size). The
    log is trimmed to the oldest of the three floors, never past the oldest kept checkpoint."""
    fleet_peers: str = ""
    """Other nodes whose CPU tier fills this one's on an engine's Lookup miss:
    name=host:port/namespace[,...] (a peer daemon's gRPC address and its log's namespace on
    this Redis deployment); empty = none."""
    fleet_node: str = ""
    """This node's name in its reads from peers; empty = the namespace."""
    fleet_ca_file: str = ""
    """PEM CA of the peers' TLS certificates; empty = plaintext. With it, tls_cert_file and
    tls_key_file are presented as the client certificate; auth_token_file's token is sent."""
    fleet_timeout_s: float = 2.0
    """Longest wait for one peer call; past it the Lookup answers without the peer's blocks."""
    fleet_refresh_ms: int = 100
    """How often the fleet index catches up with the peers' logs."""
    fleet_block_port: int = -1
    """TCP port serving block bytes to peers' daemons with sendfile (plaintext, the
    auth_token_file token); peers name it as name=host:port/namespace@PORT. -1 = off, 0 = any."""

    def __post_init__(self) -> None:
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        try:
            LogKeys(self.namespace)
        except ValueError as exc:
            raise ConfigError(f"namespace: {exc}") from exc
        try:
            redis_connect.parse(self.redis_url)
        except ValueError as exc:
            raise ConfigError(f"redis_url: {exc}") from exc
        if self.redis_wait_replicas < 0:
            raise ConfigError(f"redis_wait_replicas: must be >= 0, got {self.redis_wait_replicas}")
        if self.redis_wait_replicas and not 0 < self.redis_wait_timeout_ms < self.redis_timeout_s * 1000:
            raise ConfigError("redis_wait_timeout_ms: must be > 0 and below redis_timeout_s "
                              f"({self.redis_timeout_s * 1000:.0f} ms), got {self.redis_wait_timeout_ms}")
        if self.capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes: must be > 0, got {self.capacity_bytes}")
        if self.chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes: must be > 0, got {self.chunk_bytes}")
        if self.chunk_bytes > self.capacity_bytes:
            object.__setattr__(self, "chunk_bytes", self.capacity_bytes)
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction: must be one of {EVICTIONS}, got {self.eviction!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(f"hash_algo: must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        for name in ("lease_ms", "max_lease_ms", "sweep_interval_ms", "max_batch_events",
                     "max_request_hashes", "min_block_bytes", "max_layouts", "max_engines",
                     "max_id_bytes", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.engine_lease_s <= 0:
            raise ConfigError(f"engine_lease_s: must be > 0, got {self.engine_lease_s}")
        if self.owner_lease_s < 0.3:
            raise ConfigError(f"owner_lease_s: must be >= 0.3, got {self.owner_lease_s}")
        if self.checkpoint_interval_s <= 0 or self.checkpoint_records <= 0:
            raise ConfigError("checkpoint_interval_s and checkpoint_records: must be > 0")
        if not self.full_gc_interval_s > 0:
            raise ConfigError(f"full_gc_interval_s: must be > 0, got {self.full_gc_interval_s}")
        for name in ("retention_records", "retention_s", "retention_bytes", "checkpoint_fork_blocks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        try:
            parse_peers(self.fleet_peers)
        except ValueError as exc:
            raise ConfigError(f"fleet_peers: {exc}") from exc
        if self.fleet_timeout_s <= 0 or self.fleet_refresh_ms <= 0:
            raise ConfigError("fleet_timeout_s and fleet_refresh_ms: must be > 0")
        if not -1 <= self.fleet_block_port <= 65535:
            raise ConfigError(f"fleet_block_port: out of range: {self.fleet_block_port}")
        if self.fleet_ca_file and any(p.block_port for p in parse_peers(self.fleet_peers)):
            raise ConfigError("fleet_peers: a @block port is plaintext; not with fleet_ca_file")
        if self.fleet_block_port >= 0 and self.tls_cert_file:
            raise ConfigError("fleet_block_port: sends plaintext (sendfile); not with TLS")
        if not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"grpc_port: out of range: {self.grpc_port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: out of range: {self.metrics_port}")
        for name in ("file_mode", "unix_socket_mode"):
            if not 0 <= getattr(self, name) <= 0o777:
                raise ConfigError(f"{name}: not a permission mode: {oct(getattr(self, name))}")
        for name in ("file_group", "unix_socket_group"):
            if getattr(self, name):
                try:
                    grp.getgrnam(getattr(self, name))
                except KeyError as exc:
                    raise ConfigError(f"{name}: no such group {getattr(self, name)!r}") from exc
        try:
            check_server_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        except SecurityConfigError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def digest_bytes(self) -> int:
        return DIGEST_BYTES[self.hash_algo]

    @property
    def keys(self) -> LogKeys:
        return LogKeys(self.namespace)

    @property
    def file_gid(self) -> int | None:
        return grp.getgrnam(self.file_group).gr_gid if self.file_group else None

    @property
    def unix_socket_gid(self) -> int | None:
        return grp.getgrnam(self.unix_socket_group).gr_gid if self.unix_socket_group else None

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_cert_file)


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_mode(text: str) -> int:
    return int(text, 8)


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def _parse_float(text: str) -> float:
    """A finite number: ``nan`` passed every ``<= 0`` check below and ``inf`` made timers never fire."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _field_parser(field: dataclasses.Field[object]) -> type | object:
    if field.name in ("file_mode", "unix_socket_mode"):
        return _parse_mode
    kind = type(field.default)
    return {bool: _parse_bool, int: _parse_int, float: _parse_float}.get(kind, kind)


def _field_docs() -> dict[str, str]:
    """The attribute docstrings of OffloaddConfig, for --help (one source of truth)."""
    tree = ast.parse(inspect.getsource(OffloaddConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split()).replace("%", "%%")
    return docs


class _Parser(argparse.ArgumentParser):
    """Puts each flag's attribute docstring in front of its help only when help is shown: reading
    them parses this module's source (~10 ms of every start otherwise)."""

    _documented = False

    def format_help(self) -> str:
        if not self._documented:
            self._documented = True
            docs = _field_docs()
            for action in self._actions:
                if action.dest in docs:
                    action.help = f"{docs[action.dest]} {action.help}"
        return super().format_help()


def load_config(argv: Sequence[str] | None, env: Mapping[str, str]) -> OffloaddConfig:
    """Build the config from flags, then ``KVD_*`` environment, then defaults."""
    parser = _Parser(
        prog="offloadd",
        description="The per-node KV offload daemon: owns the host tier (a shared-memory arena), "
        "applies and fences engines' KV events, and keeps the durable event log in Redis. "
        "Every flag can also be set as KVD_<NAME> in the environment; flags win.",
        epilog="example: offloadd --redis-url redis://127.0.0.1:6379/0 --namespace node-a "
        "--capacity-bytes 8589934592 --grpc-port 50051   (engines attach with --offloadd "
        "HOST:50051 --offload; kv-bridge --namespace node-a republishes the log)",
    )
    fields = dataclasses.fields(OffloaddConfig)
    for field in fields:
        parser.add_argument(
            "--" + field.name.replace("_", "-"), dest=field.name, default=None,
            help=f"(env KVD_{field.name.upper()}; default "
                 f"{oct(field.default) if _field_parser(field) is _parse_mode else repr(field.default)})",  # type: ignore[arg-type]
        )
    args = parser.parse_args(argv)
    values: dict[str, object] = {}
    for field in fields:
        raw = getattr(args, field.name)
        if raw is None:
            raw = env.get("KVD_" + field.name.upper())
        if raw is None and field.name == "redis_url":
            raw = env.get("REDIS_URL")
        if raw is None:
            continue
        conv = _field_parser(field)
        try:
            values[field.name] = conv(raw)  # type: ignore[operator]
        except ValueError as exc:
            raise ConfigError(f"{field.name}: {exc}") from exc
    return OffloaddConfig(**values)  # type: ignore[arg-type]
