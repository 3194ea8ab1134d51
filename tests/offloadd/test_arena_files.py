"""The daemon's side of the arena files: read with pread, the generation table written with
pwrite, a file resized by another process reported and repaired (never a SIGBUS)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from offloadd.arena import ArenaGeometry, create_chunk_file
from offloadd.slot_generations import SlotGenerations, generations_path
from offloadd.tier.arena_files import ArenaFiles

SLOT = 64


def make_files(tmp_path: Path, num_chunks: int = 2, per_chunk: int = 4) -> ArenaFiles:
    geometry = ArenaGeometry(SLOT, per_chunk, num_chunks * per_chunk, str(tmp_path / "kvd-t-L1-C{chunk}"))
    files = ArenaFiles(geometry)
    for chunk in range(num_chunks):
        path = geometry.chunk_path(chunk)
        create_chunk_file(path, geometry.chunk_file_bytes, 0o600, None)
        with open(path, "r+b") as f:
            f.write(bytes(range(chunk * 100, chunk * 100 + per_chunk)) * SLOT)
        files.open_chunk(chunk)
    return files


def test_short_read_is_none_and_check_repairs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = make_files(tmp_path)
    want = files.read(5)
    assert want is not None and len(want) == SLOT
    path = files.geometry.chunk_path(1)
    os.truncate(path, SLOT + 10)  # slot 4 whole, slot 5 cut, 6 and 7 gone
    assert files.read(4) is not None
    assert files.read(5) is None and files.read(7) is None
    with caplog.at_level(logging.WARNING, logger="offloadd.arena"):
        assert files.check() == {1: SLOT + 10}
        assert files.check() == {}  # given back its size: reported once
    assert [r.getMessage().count(path) for r in caplog.records] == [1]
    assert os.stat(path).st_size == 4 * SLOT
    assert files.lost_slots(1, SLOT + 10) == range(5, 8)
    assert files.lost_slots(0, 0) == range(0, 4)
    cut = files.read(5)
    assert cut is not None and cut[10:] == bytes(SLOT - 10)  # readable again: its tail is gone
    assert files.read(6) == bytes(SLOT)
    with pytest.raises(IndexError):
        files.read(8)
    files.close()


def test_daemon_table_survives_truncation(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = generations_path(str(tmp_path / "kvd-t-L1-C{chunk}"))
    daemon = SlotGenerations.create(path, 8, 0o600, None)
    daemon[1], daemon[6] = 11, 66
    os.truncate(path, 0)  # a mapped daemon would die on its next write (SIGBUS)
    with caplog.at_level(logging.WARNING, logger="offloadd.slot_generations"):
        daemon[2] = 22  # grows it back, every entry written again
    assert sum(path in r.getMessage() for r in caplog.records) == 1
    assert os.stat(path).st_size == 64
    reader = SlotGenerations(path, 8)  # the engines' read-only map is unchanged
    assert [reader[s] for s in range(8)] == [0, 11, 22, 0, 0, 0, 66, 0]
    os.truncate(path, 16)
    assert daemon.check() and not daemon.check()
    assert [reader[s] for s in range(8)] == [0, 11, 22, 0, 0, 0, 66, 0]
    with pytest.raises(TypeError):
        reader[0] = 1  # type: ignore[index]
    reader.close()
    daemon.close()
