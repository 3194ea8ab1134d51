"""A node's daemon fills its CPU tier from a peer's on an engine's Lookup miss (issue 21 part 2):
two daemons on loopback sharing one Redis (namespaces node-a and node-b); b is started with
``--fleet-peers a=<a>/node-a``. The engine's interface is unchanged: its Lookup on b answers
the chain a holds, stored on b with provenance "fleet:a" in b's log; a layout that differs is a
miss; a peer that is gone costs the remote part, never an error or a wrong block; a tiny-model
engine on b gets a's prefix as a CPU-tier hit with the logits of a cold run."""

from __future__ import annotations

import random
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.model.checkpoint import TinyModelSpec, write_tiny_model
from engine.offload.config import OffloadConnectorConfig
from engine.offload.connector import OffloadingConnector
from engine.sampling import SamplingParams
from events.schema import BlockStored
from offloadd.client import GroupQuery, OffloadClient
from tests.support.offloadd_proc import DaemonProcess
from tests.support.synthetic_engine import GROUP, SLOT, SyntheticStorer, digest, served_blocks_match

CHAIN = 8


def _peer_args(a: DaemonProcess) -> tuple[str, ...]:
    return ("--fleet-peers", f"a={a.target}/{a.namespace}", "--fleet-refresh-ms", "50",
            "--fleet-timeout-s", "1.0")


@pytest.fixture
def nodes(tmp_path: Path, redis_url: str) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=64 * SLOT)
    a.start()
    b = DaemonProcess(tmp_path / "b", redis_url, "node-b", capacity_bytes=64 * SLOT,
                      extra_args=_peer_args(a), metrics=True)
    b.start()
    yield a, b
    a.kill()
    b.kill()


def _store_on(a: DaemonProcess) -> list[bytes]:
    storer = SyntheticStorer(a.target, "a-store", chain_len=CHAIN, max_chains=1).start()
    deadline = time.monotonic() + 20
    while storer.stats.stores < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    storer.stop()
    assert storer.stats.stores == 1
    return [digest("a-store", i) for i in range(CHAIN)]


def _lookup_until(client: OffloadClient, engine_id: str, chain: list[bytes], want: int) -> int:
    """Lookups until ``want`` blocks are a hit (the index follows a's log within ~50 ms)."""
    deadline = time.monotonic() + 10
    while True:
        got = client.lookup(engine_id, [GroupQuery(0, tuple(chain))]).results[0].num_prefix
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_lookup_on_b_is_served_from_a(nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    chain = _store_on(a)
    with OffloadClient(b.target) as local:
        arena = local.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            assert _lookup_until(local, "b-eng", chain, CHAIN) == CHAIN
            assert served_blocks_match(local, "b-eng", arena, chain) == (CHAIN, [])
        finally:
            arena.close()
        stored = [e for r in local.subscribe(1) if r.source == "offloadd" for e in r.events
                  if isinstance(e, BlockStored)]
        assert [(e.medium, e.provenance, len(e.block_hashes)) for e in stored] == [("CPU", "fleet:a", CHAIN)]
        assert stored[0].parent_block_hash is None and len(stored[0].token_ids) == CHAIN * GROUP.block_size
    text = urllib.request.urlopen(f"http://127.0.0.1:{b.metrics_port}/metrics", timeout=5).read().decode()
    assert "offloadd_fleet_fills_total 1.0" in text and f"offloadd_fleet_blocks_total {CHAIN}.0" in text
    with OffloadClient(a.target) as peer:  # a's own log says nothing of where its blocks came from
        mine = [e for r in peer.subscribe(1) for e in r.events if isinstance(e, BlockStored)]
        assert mine and all(e.provenance is None for e in mine)


def test_other_layout_is_a_miss(nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    chain = _store_on(a)
    other = replace(GROUP, block_bytes=2 * SLOT, layout="other-layout")
    with OffloadClient(b.target) as local:
        local.register_engine("b-other", 1, "synthetic", [other])
        time.sleep(0.3)  # the index has a's chain by now
        assert local.lookup("b-other", [GroupQuery(0, tuple(chain))]).results[0].num_prefix == 0
        assert local.stats().num_blocks == 0


def test_a_peer_that_is_gone_is_a_miss_not_an_error(nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    chain = _store_on(a)
    time.sleep(0.3)  # b's index knows a holds the chain
    a.kill()
    with OffloadClient(b.target) as local:
        local.register_engine("b-eng", 1, "synthetic", [GROUP])
        t0 = time.monotonic()
        assert local.lookup("b-eng", [GroupQuery(0, tuple(chain))]).results[0].num_prefix == 0
        assert time.monotonic() - t0 < 3.0  # one --fleet-timeout-s at most, and then some
        stats = local.stats()
        assert stats.num_blocks == 0 and all(s.num_reserved == 0 for s in stats.layouts)


@pytest.mark.parametrize(("args", "says"), [
    (("--fleet-peers", "a=nohost"), "name=host:port/namespace"),
    (("--fleet-peers", "a=h:1/n,a=h:2/m"), "named twice"),
    (("--fleet-peers", "a=h:1/n@9", "--fleet-ca-file", "/x"), "@block port is plaintext"),
    (("--fleet-block-port", "70000"), "fleet_block_port: out of range"),
    (("--fleet-timeout-s", "0"), "fleet_timeout_s"),
])
def test_bad_fleet_flags_are_one_line_at_start(tmp_path: Path, redis_url: str, args: tuple[str, ...],
                                               says: str) -> None:
    d = DaemonProcess(tmp_path / "x", redis_url, "node-x", extra_args=args)
    out = subprocess.run(d.args, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


_TINY = TinyModelSpec(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
BS, PROMPT = 16, 320


def _engine(model: Path, daemon: DaemonProcess, engine_id: str) -> tuple[LLM, OffloadingConnector]:
    conn = OffloadingConnector(OffloadConnectorConfig(daemon.target, engine_id, "tiny"))
    llm = LLM(str(model), connector=conn, device="cpu", dtype="float32",
              num_gpu_blocks=PROMPT // BS * 3 + 8, max_num_batched_tokens=PROMPT + BS,
              max_model_len=PROMPT + 64)
    return llm, conn


def test_engine_on_b_loads_a_prefix_computed_on_a(tmp_path: Path, redis_url: str) -> None:
    model = write_tiny_model(tmp_path / "model", _TINY)
    slot = 2 * _TINY.num_layers * _TINY.num_kv_heads * (_TINY.hidden_size // _TINY.num_heads) * BS * 4
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=256 * slot)
    a.start()
    b = DaemonProcess(tmp_path / "b", redis_url, "node-b", capacity_bytes=256 * slot,
                      extra_args=_peer_args(a))
    b.start()
    prompt = [random.Random(7).randrange(_TINY.vocab_size) for _ in range(PROMPT)]
    params = SamplingParams(max_tokens=4, temperature=0.0, return_logits=True)
    try:
        llm_a, conn_a = _engine(model, a, "engine-a")
        want = llm_a.generate(prompt, params)[0]
        assert want.num_external_cached_tokens == 0 and conn_a.flush()
        conn_a.close()
        time.sleep(0.3)  # b's index follows a's log
        llm_b, conn_b = _engine(model, b, "engine-b")
        got = llm_b.generate(prompt, params)[0]
        conn_b.close()
        assert got.num_external_cached_tokens == (PROMPT - 1) // BS * BS
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logits is not None and want.outputs[0].logits is not None
        for x, y in zip(got.outputs[0].logits, want.outputs[0].logits, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    finally:
        a.kill()
        b.kill()


def test_a_long_prefix_is_read_over_several_streams(tmp_path: Path, redis_url: str) -> None:
    from offloadd.fleet.fill import STREAM_BLOCKS

    n = 2 * STREAM_BLOCKS + 5  # three ReadBlocks streams side by side
    a = DaemonProcess(tmp_path / "a", redis_url, "node-a", capacity_bytes=4 * n * SLOT)
    a.start()
    b = DaemonProcess(tmp_path / "b", redis_url, "node-b", capacity_bytes=4 * n * SLOT,
                      extra_args=_peer_args(a))
    b.start()
    try:
        storer = SyntheticStorer(a.target, "long", chain_len=n, max_chains=1).start()
        deadline = time.monotonic() + 20
        while storer.stats.stores < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        storer.stop()
        chain = [digest("long", i) for i in range(n)]
        with OffloadClient(b.target) as local:
            arena = local.register_engine("b-eng", 1, "synthetic", [GROUP]).map_arena(0)
            try:
                assert _lookup_until(local, "b-eng", chain, n) == n
                assert served_blocks_match(local, "b-eng", arena, chain) == (n, [])
            finally:
                arena.close()
    finally:
        a.kill()
        b.kill()
