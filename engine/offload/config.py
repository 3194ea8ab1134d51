"""Configuration of the offload connector (the engine's side of the host tier).

Capacity and eviction of the host tier belong to offloadd (``--capacity-bytes``,
``--eviction lru|arc``), because one daemon serves every engine of the node; the connector
only decides whether and how this engine uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

CopyMode = Literal["auto", "kernel", "memcpy", "batch", "mixed"]
COPY_MODES: Final[tuple[CopyMode, ...]] = ("auto", "kernel", "memcpy", "batch", "mixed")


@dataclass(frozen=True)
class OffloadConnectorConfig:
    """Everything the connector needs; invalid values are refused at construction."""

    target: str
    """offloadd gRPC target: ``host:port`` or ``unix:/path``."""
    engine_id: str
    """This engine's id at the daemon (the same as the id its KV events are published under)."""
    model_namespace: str
    """Blocks are shared only between engines of one namespace (same model and weights)."""
    enabled: bool = True
    """Off: the connector answers no hits and stores nothing (the engine runs as without it)."""
    incarnation: int = 0
    """Registration incarnation; 0 picks a time-based one."""
    block_size_multiple: int = 1
    """Offloaded block = this many engine blocks (vLLM's offloading ``block_size`` option): fewer,
    larger slots and copies; a prefix is stored and hit in whole offloaded blocks."""
    load: bool = True
    """Look up and load CPU-tier prefixes on admission."""
    store: bool = True
    """Store newly full blocks after each step."""
    lease_ms: int = 0
    """Lifetime of pins and reservations at the daemon; 0 (default): the daemon's own
    ``lease_ms``, so the operator of the node sets how long a dead engine's pins and
    reservations outlive it."""
    timeout_s: float = 5.0
    """Deadline of each control RPC."""
    max_pending_store_bytes: int = 512 << 20
    """Staged KV bytes waiting for the store worker; past this, new stores are dropped (counted)
    rather than slowing generation down."""
    copy_mode: CopyMode = "auto"
    """CUDA only: ``kernel`` moves blocks with one gather/scatter kernel through the registered
    (mapped) arena; ``memcpy`` with one DMA copy (cudaMemcpyAsync) per run of adjacent slots;
    ``batch`` the same DMA copies issued with one cudaMemcpyBatchAsync (CUDA >= 12.8 runtime, else
    ``memcpy``); ``mixed`` moves 3/4 of the blocks by DMA (``batch`` when available) while the
    kernel moves the rest concurrently; ``auto`` picks per copy: DMA alone when the slots come in
    runs of several blocks, else ``mixed`` (engine.offload.copies)."""
    layerwise: bool = True
    """Load a CPU-tier hit layer by layer while the step computes the layers already loaded
    (engine.offload.layerwise); off: the whole copy completes before the step starts."""
    layer_copies: Literal["halving", "per-layer"] = "halving"
    """CUDA, layer by layer: ``halving`` copies a load in units of layers that halve toward the
    last layer (16 layers: 8, 4, 2, 1, 1: fewer, larger copies beside the step; DECISIONS 71);
    ``per-layer``: one copy per layer (engine.offload.layer_plan.copy_units)."""
    speculate: bool = True
    """Start a hit's copies, with no RPC, from the slots the engine remembers (it stored the
    blocks, or a lookup answered them) when the daemon's generation table vouches for them,
    and check the table again before the step's result is used (engine.offload.view); off:
    always ask first (a pinning Lookup before the copies)."""
    retry_register_s: float = 5.0
    """After the daemon was unreachable, how long to wait before registering again."""

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("target must name the offloadd gRPC endpoint (host:port or unix:/path)")
        if not self.engine_id:
            raise ValueError("engine_id must not be empty")
        if not self.model_namespace:
            raise ValueError("model_namespace must not be empty")
        if self.block_size_multiple < 1:
            raise ValueError(f"block_size_multiple must be >= 1, got {self.block_size_multiple}")
        if self.incarnation < 0:
            raise ValueError(f"incarnation must be >= 0, got {self.incarnation}")
        if self.lease_ms < 0:
            raise ValueError(f"lease_ms must be >= 0, got {self.lease_ms}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_pending_store_bytes <= 0:
            raise ValueError(f"max_pending_store_bytes must be > 0, got {self.max_pending_store_bytes}")
        if self.copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode must be one of {COPY_MODES}, got {self.copy_mode!r}")
        if self.layer_copies not in ("halving", "per-layer"):
            raise ValueError(f"layer_copies must be halving or per-layer, got {self.layer_copies!r}")
        if self.retry_register_s < 0:
            raise ValueError(f"retry_register_s must be >= 0, got {self.retry_register_s}")
