"""kv-router configuration: one frozen dataclass, built once from flags (and an optional TOML
file of engines) at the entry point."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

from events.hashing import DEFAULT_SEED, HASH_ALGOS, HashAlgo

Policy = Literal["kv", "round-robin", "least-loaded", "random"]
POLICIES: Final[tuple[Policy, ...]] = ("kv", "round-robin", "least-loaded", "random")
DEFAULT_NODE_SOURCE: Final = "offloadd"
"""The source name of a node's host tier in the log (offloadd's own events)."""


_OPTIONS: Final = {"source": "source", "node": "node_source", "grpc": "grpc"}


class RouterConfigError(ValueError):
    """A flag or config file value the router cannot run with; the message says which."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine behind the router."""

    name: str
    url: str
    """Base URL of the engine's OpenAI HTTP API, e.g. http://127.0.0.1:8001"""
    source: str = ""
    """The engine's source in the event log (its --engine-id); default: ``name``."""
    node_source: str = DEFAULT_NODE_SOURCE
    """The source of the host tier on the engine's node (offloadd)."""
    grpc: str = ""
    """The engine's gRPC Generate target (HOST:PORT), for the router's Generate front door."""

    def __post_init__(self) -> None:
        if not self.name:
            raise RouterConfigError("an engine needs a name")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RouterConfigError(f"engine {self.name!r}: url must be http(s)://HOST:PORT, got {self.url!r}")
        try:
            parts.port  # noqa: B018 - reading it checks it
        except ValueError as exc:  # out of range or not a number: every request would fail on it
            raise RouterConfigError(f"engine {self.name!r}: {exc} in {self.url!r}") from None
        if not self.source:
            object.__setattr__(self, "source", self.name)
        object.__setattr__(self, "url", self.url.rstrip("/"))

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """``NAME=URL[,source=ID][,node=SOURCE][,grpc=HOST:PORT]`` (``URL`` alone names the
        engine by it)."""
        head, *opts = text.split(",")
        name, sep, url = head.partition("=")
        if not sep:
            name, url = head, head
        kw: dict[str, str] = {}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep or key not in _OPTIONS:
                raise RouterConfigError(f"--engine {text!r}: options are source=ID, node=SOURCE and "
                                        f"grpc=HOST:PORT, got {opt!r}")
            kw[_OPTIONS[key]] = value
        return cls(name.strip(), url.strip(), **kw)


@dataclass(frozen=True)
class RouterConfig:
    engines: tuple[EngineSpec, ...]
    policy: Policy = "kv"
    host: str = "0.0.0.0"
    port: int = 8100
    """Port of the OpenAI HTTP API, /health, /metrics and the fleet page."""
    grpc_port: int = -1
    """Port of the gRPC Generate front door (-1: off; engines need a grpc= target)."""
    bridge_pub: str = ""
    """kv-bridge's PUB endpoint (tcp://HOST:5557); empty: no cache view (kv falls back to load)."""
    bridge_replay: str = ""
    topic: str = "kv-events"
    model_dir: str = ""
    """The engines' model directory: its tokenizer and chat template (empty: bytes, plain)."""
    served_model_name: str = ""
    """The model name clients use (default: the model directory's name, else 'model')."""
    block_size: int = 16
    hash_seed: str = DEFAULT_SEED
    """The engines' block-hash seed (kv-router --hash-seed follows $PYTHONHASHSEED as they do)."""
    hash_algo: HashAlgo = "sha256_cbor"
    gpu_weight: float = 1.0
    """Score per cached token in the engine's GPU tier."""
    cpu_weight: float = 0.8
    """Score per cached token in the node's host tier (loaded, not recomputed, but copied)."""
    load_weight: float = 64.0
    """Score taken off per request in flight on the engine (in cached-token units)."""
    model_pressure: bool = True
    """Predict the GPU prefix expected at admission: the view, plus this router's finished
    requests not yet in it, minus the evictions its pending requests will cause (router.pressure)."""
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    max_attempts: int = 3
    """Engines tried for one request before it fails (a retry only before any token was sent)."""
    seed: int = 0
    """Seeds the random policy."""
    engine_names: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not self.engines:
            raise RouterConfigError("give at least one engine (--engine NAME=URL or --config FILE)")
        names = tuple(e.name for e in self.engines)
        if len(set(names)) != len(names):
            raise RouterConfigError(f"engine names must be unique, got {list(names)}")
        object.__setattr__(self, "engine_names", names)
        if self.policy not in POLICIES:
            raise RouterConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise RouterConfigError(f"hash algorithm must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.grpc_port >= 0 and not any(e.grpc for e in self.engines):
            raise RouterConfigError("--grpc-port needs engines with a gRPC target (--engine NAME=URL,grpc=HOST:PORT)")
        if bool(self.bridge_pub) != bool(self.bridge_replay):
            raise RouterConfigError("give both --bridge-pub and --bridge-replay, or neither")
        for name in ("block_size", "max_attempts"):
            if getattr(self, name) < 1:
                raise RouterConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise RouterConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("gpu_weight", "cpu_weight", "load_weight"):
            if not 0 <= getattr(self, name) < math.inf:  # a nan weight made every score nan
                raise RouterConfigError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.model_dir and not Path(self.model_dir).is_dir():
            raise RouterConfigError(f"model directory {self.model_dir!r} does not exist")
        if not self.served_model_name:
            name = Path(self.model_dir).resolve().name if self.model_dir else "model"
            object.__setattr__(self, "served_model_name", name)


def engines_from_file(path: str) -> list[EngineSpec]:
    """``[[engines]]`` tables of a TOML file: name, url, and optionally source and node."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RouterConfigError(f"cannot read {path}: {exc}") from exc
    tables = data.get("engines")
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise RouterConfigError(f"{path}: expected [[engines]] tables with name and url")
    out = []
    for t in tables:
        unknown = set(t) - {"name", "url", "source", "node", "grpc"}
        if unknown or not isinstance(t.get("name"), str) or not isinstance(t.get("url"), str):
            raise RouterConfigError(f"{path}: an engine needs string name and url (and may have source, node): {t}")
        out.append(EngineSpec(t["name"], t["url"], str(t.get("source", "")), str(t.get("node", DEFAULT_NODE_SOURCE)),
                              str(t.get("grpc", ""))))
    return out
