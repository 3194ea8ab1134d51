"""The engine's one frozen configuration, built at the entry point and passed down."""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass, field
from typing import Final

import torch

from events.hashing import HASH_ALGOS, HashAlgo, env_hash_seed

DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


_ENGINES_HERE = itertools.count()


def default_engine_id() -> str:
    """``{hostname}-{pid}`` (``-N`` added for the Nth further engine of one process): distinct
    for every engine running at once (a pid is unique on its host, a hostname across hosts, a
    container's hostname is its id), yet the same again for a container restarted in place,
    whose engine is again its first process, so offloadd fences the old incarnation's blocks.
    Pass ``--engine-id`` for a name that stays when the engine moves (docs/DECISIONS.md)."""
    n = next(_ENGINES_HERE)
    base = f"{socket.gethostname()}-{os.getpid()}"
    return base if n == 0 else f"{base}-{n}"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; ``validate`` refuses inconsistent values with a clear message."""

    model_dir: str
    device: str = "cpu"
    """torch device string: "cpu" (default) or "cuda" / "cuda:N"."""
    dtype: str = "float32"
    """Weights, activations and KV cache: float32, bfloat16 or float16 (half types need CUDA)."""
    block_size: int = 16
    """Tokens per KV block (and per hashed block)."""
    num_gpu_blocks: int = 256
    """KV pool size in blocks, per KV-cache group (one extra null block is reserved)."""
    max_num_batched_tokens: int = 512
    """Token budget of one step (prefill chunks + decodes)."""
    max_num_seqs: int = 32
    """Most requests running at once."""
    max_model_len: int | None = None
    """Prompt + output tokens per request; defaults to the model's max_position_embeddings."""
    default_max_tokens: int = 64
    """max_tokens for requests that give none (gRPC sends 0 for 'unset')."""
    hash_seed: str = field(default_factory=lambda: env_hash_seed(os.environ))
    """Block-hash seed: vLLM's rule by default ($PYTHONHASHSEED, else "vllm-none-hash")."""
    hash_algo: HashAlgo = "sha256_cbor"
    enable_prefix_caching: bool = True
    hold_prefix_on_arrival: bool = True
    """Protect a queued request's cached prefix from eviction until its admission (engine.prefix_holds)."""
    engine_id: str = field(default_factory=default_engine_id)
    """This engine's source name in the event log and at offloadd; unique among live engines."""
    seed: int = 0
    """Seeds sampling for requests that bring no seed of their own."""
    enforce_eager: bool = False
    """CUDA: run every step eagerly; by default small steps replay captured CUDA graphs."""
    cuda_graph_max_tokens: int = 512
    """CUDA: largest padded step (requests x tokens per request, powers of two) run as a graph."""
    async_scheduling: bool = True
    """CUDA graphs, no offload connector: launch the next greedy decode step before the last
    step's tokens are read (engine.step_chain); the host's work of a step then overlaps the
    GPU's next one (decode 1.14-1.16x as fast at batch 1, 1.26-1.51x at batch 32 on an H200,
    two runs, DECISIONS 50).
    Inert elsewhere (CPU, ``enforce_eager``, an offload connector: steps stay synchronous)."""

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.dtype != "float32" and not self.device.startswith("cuda"):
            raise ValueError(f"dtype {self.dtype} needs a CUDA device; use float32 on {self.device}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        for name in ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs", "default_max_tokens",
                     "cuda_graph_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
