"""ReadBlocks answers are serialized by hand (offloadd.codec.block_data_wire, the block's bytes
copied once): they parse as the BlockData protobuf builds, byte for byte as long."""

from __future__ import annotations

import pytest
from kvcache.v1 import offload_pb2

from offloadd import codec
from offloadd.messages import BlockData


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16_383, 16_384, 1 << 20])
def test_wire_parses_as_the_protobuf(n: int) -> None:
    data = (bytes(range(256)) * (n // 256 + 1))[:n]
    for block in (BlockData(b"h" * 32, data, 2**64 - 1, b"p" * 32, (1, 2, 3), b"\xa0", "lora"),
                  BlockData(b"h" * 32, data, 7)):
        wire = codec.block_data_wire(block)
        assert codec.block_data_from_proto(offload_pb2.BlockData.FromString(wire)) == block
        assert len(wire) == len(codec.block_data_to_proto(block).SerializeToString())
