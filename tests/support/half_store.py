"""An engine that dies mid-store: ``python -m tests.support.half_store TARGET ENGINE_ID N``.

Registers, reserves N new blocks, writes the first half of each reserved slot's bytes, prints
the reserved slots on one line ("RESERVED s1 s2 ...") and then waits to be SIGKILLed before it
ever commits. It also pins blocks ``digest("base", 0..3)`` (stored by the test beforehand) under
a lease it never releases.
"""

from __future__ import annotations

import sys
import time

from offloadd.client import GroupQuery, OffloadClient
from tests.support.synthetic_engine import GROUP, SLOT, block_bytes, digest


def main(target: str, engine_id: str, n: int) -> None:
    from offloadd.client import BlockToStore

    with OffloadClient(target) as client:
        arena = client.register_engine(engine_id, 1, "synthetic", [GROUP]).map_arena(0)
        blocks = [BlockToStore(digest(engine_id, i), digest(engine_id, i - 1) if i else None, (i, 1, 2, 3))
                  for i in range(n)]
        res = client.reserve(engine_id, 0, blocks)
        slots = [slot for _, slot in res.blocks]
        for b, slot in zip(blocks, slots, strict=True):
            arena.slot_view(slot)[: SLOT // 2] = block_bytes(b.block_hash)[: SLOT // 2]
        base = tuple(digest("base", i) for i in range(4))
        client.lookup(engine_id, [GroupQuery(0, base)], pin=True)
        print("RESERVED", *slots, flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
