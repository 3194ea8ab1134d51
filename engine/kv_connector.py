"""Hook points for an offload connector (a second KV tier), and the null connector.

The engine core only knows this protocol; the real connector (engine/offload/connector.py)
talks to offloadd. Its calls, in order:

- at start: ``register_kv_caches`` once;
- at admission (the scheduler), after the GPU prefix-cache hit: ``lookup``, then ``load`` into
  the blocks allocated for the hit (any number of requests);
- one step, every step that ran:

  1. ``take_layer_waits`` right before the step; the step waits for each layer's loads right
     before that layer;
  2. ``finish_loads`` once the step is enqueued: every load of the step complete in stream
     order, whatever the step did;
  3. ``store`` with the blocks that became full and got their hash in the step;
  4. ``check_loads`` before the step's tokens are read: which loads proved wrong;
  5. ``step_done`` once the step's outputs are made.

  A step that raised still calls ``finish_loads``, ``check_loads`` and ``step_done`` (not
  ``store``), whether or not it had reached them: a repeated ``finish_loads`` or
  ``check_loads`` finds nothing left and does nothing;
- ``request_finished`` when a request leaves (finished, aborted or preempted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.kv_cache import KVCacheGroup


@dataclass(frozen=True)
class NewBlocks:
    """Blocks of one request and one group that were computed, became full and were hashed in
    the last step; their KV is in ``KVCacheGroup.tensor[block_ids[i]]``."""

    request_id: str
    group_idx: int
    block_ids: tuple[int, ...]
    digests: tuple[bytes, ...]
    """Full digests (chained, as events.hashing.BlockHasher computes them)."""
    block_indices: tuple[int, ...]
    """Position of each block in the request (block i holds tokens [i*bs, (i+1)*bs))."""
    parents: tuple[bytes | None, ...] = ()
    """Digest of the block before each one in the request (None for block 0)."""
    token_ids: tuple[tuple[int, ...], ...] = ()
    """The ``block_size`` token ids of each block (a second tier logs them with the block)."""


class LayerWaits(Protocol):
    """Loads in flight while a step runs, completed layer by layer."""

    def wait_layer(self, group_idx: int, layer: int) -> None:
        """Make the step's next work see layer ``layer`` (of group ``group_idx``'s tensor) of
        every loaded block in place: called before the step reads or writes that layer."""
        ...


class OffloadConnector(Protocol):
    def register_kv_caches(self, groups: Sequence[KVCacheGroup]) -> None:
        """Called once at engine start with every group's tensor, block_bytes, dtype and layout."""
        ...

    def lookup(self, request_id: str, digests: Sequence[bytes], num_gpu_hit_blocks: int) -> int:
        """On admission: how many blocks right after the GPU hit (``digests[num_gpu_hit_blocks:]``,
        contiguous) the second tier can load. Blocks returned here should stay pinned until
        ``load`` or ``request_finished``."""
        ...

    def load(
        self, request_id: str, digests: Sequence[bytes], block_ids: Mapping[int, Sequence[int]]
    ) -> None:
        """Copy the KV of ``digests`` into the freshly allocated GPU blocks ``block_ids[group]``
        (aligned with ``digests``). Raises before copying anything on bad input. The copy is
        complete before the step, or completes layer by layer (``take_layer_waits``) and at
        the latest by ``finish_loads``."""
        ...

    def take_layer_waits(self) -> LayerWaits | None:
        """Right before the step: the loads it must wait for per layer, or None when every load
        is already complete in stream order."""
        ...

    def finish_loads(self) -> None:
        """Once the step is enqueued, whatever it did (it may not have waited for every layer):
        every load issued for it is complete in stream order, so that what follows on the
        compute stream (the store's snapshot, the next step) sees the loaded blocks."""
        ...

    def store(self, new_blocks: Sequence[NewBlocks]) -> None:
        """After ``finish_loads``: the blocks that became full and hashed in the step. Must not
        block generation; touches no load (with no blocks it does nothing)."""
        ...

    def check_loads(self) -> set[str]:
        """After ``store``, before the step's result is used: the requests whose loads turned
        out wrong (started from slots the second tier no longer held for them). What ``store``
        got for them is dropped; the engine forgets the blocks they registered in the step,
        drops their result and admits them again."""
        ...

    def step_done(self) -> None:
        """After every step that ran (whatever happened), once its outputs are made: what
        ``finish_loads``, ``store`` and ``check_loads`` prepared may go to the background now."""
        ...

    def request_finished(self, request_id: str) -> None:
        """The request finished or was aborted/preempted; release whatever it pinned."""
        ...


class NullConnector:
    """No second tier: nothing to load, nothing stored."""

    def register_kv_caches(self, groups: Sequence[KVCacheGroup]) -> None:
        pass

    def lookup(self, request_id: str, digests: Sequence[bytes], num_gpu_hit_blocks: int) -> int:
        return 0

    def load(
        self, request_id: str, digests: Sequence[bytes], block_ids: Mapping[int, Sequence[int]]
    ) -> None:
        pass

    def take_layer_waits(self) -> LayerWaits | None:
        return None

    def finish_loads(self) -> None:
        pass

    def store(self, new_blocks: Sequence[NewBlocks]) -> None:
        pass

    def check_loads(self) -> set[str]:
        return set()

    def step_done(self) -> None:
        pass

    def request_finished(self, request_id: str) -> None:
        pass
