"""kv-ingest following vLLM-style publishers into a real offloadd: gaps, rings, restarts, ranks."""

from __future__ import annotations

from collections.abc import Callable

from events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from ingest.sink import MERGE_VALUES
from ingest.vllm_publisher import VllmStylePublisher
from offloadd.client import OffloadClient
from tests.ingest.conftest import Pod, records, state_of, stored, view_is, wait_for
from tests.support.ingest_proc import IngestProcess, vllm_endpoints


def test_follows_live_batches_and_fills_dropped_ones_from_the_replay_ring(
    client: OffloadClient, pod_a: Callable[..., Pod],
) -> None:
    pod = pod_a()
    vllm, ingest = pod.vllm, pod.ingest
    vllm.publish([stored(1)])  # before kv-ingest listens: found in the ring at first contact
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({1})}), what="first contact")
    vllm.publish([stored(2, parent=1)])
    vllm.publish([stored(3, parent=2)], drop=True)  # lost on the way
    vllm.publish([BlockRemoved((1,), "GPU")])  # shows the gap
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({2, 3})}), what="the gap filled")
    vllm.publish([stored(9)], drop=True)  # lost, and nothing follows: found while quiet
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({2, 3, 9})}), what="the ring's batches")
    recs = [r for r in records(client) if r.source == "pod-a"]
    assert len({r.incarnation for r in recs}) == 1  # one life, every batch once, in order
    assert [e for r in recs for e in r.events] == [
        stored(1), stored(2, parent=1), stored(3, parent=2), BlockRemoved((1,), "GPU"), stored(9)]
    assert ingest.metric("kvingest_gaps_total", source="pod-a") == 2
    assert ingest.metric("kvingest_replayed_batches_total", source="pod-a") >= 3
    assert ingest.metric("kvingest_resyncs_total", source="pod-a", reason="first contact") == 1
    assert ingest.metric("kvingest_resyncs_total", source="pod-a") == 1  # no other re-sync
    assert state_of(client).violations == []


def _cleared(client: OffloadClient, source: str) -> bool:
    """The log clears ``source`` somewhere (its first life starts without a clear)."""
    return any(isinstance(e, AllBlocksCleared)
               for r in records(client) if r.source == source for e in r.events)


def test_a_publisher_restart_is_a_new_incarnation(
    client: OffloadClient, publishers: list[VllmStylePublisher], pod_a: Callable[..., Pod],
) -> None:
    pod = pod_a()
    vllm, ingest = pod.vllm, pod.ingest
    vllm.publish([stored(1)])
    vllm.publish([stored(2, parent=1)])
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({1, 2})}), what="the first life")
    first_inc = records(client)[-1].incarnation
    vllm.close()  # the engine restarts: its cache and its ring are gone
    vllm = VllmStylePublisher(pod.pub, pod.replay)
    publishers.append(vllm)
    wait_for(view_is(client, {}), what="a quiet restart found by the idle check")
    vllm.publish([stored(5)])  # seq 0 again
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({5})}), what="the second life")
    last = [r for r in records(client) if r.source == "pod-a"][-1]
    assert last.incarnation > first_inc and last.source_seq == 1
    assert _cleared(client, "pod-a")
    assert ingest.metric("kvingest_resyncs_total", source="pod-a", reason="publisher restarted (its ring ends before our seq)") == 1


def test_a_gap_the_ring_no_longer_holds_resyncs_from_the_ring(
    client: OffloadClient, pod_a: Callable[..., Pod],
) -> None:
    # An engine before vLLM 0.33: replies without the topic frame.
    pod = pod_a(ring_size=4, reply_topic=False)
    vllm, ingest = pod.vllm, pod.ingest
    vllm.publish([stored(100)])
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({100})}), what="the first batch")
    for h in range(1, 11):
        vllm.publish([stored(h)], drop=True)  # 10 batches lost; the ring keeps the last 4
    vllm.publish([stored(11)])
    # Re-synced: cleared, rebuilt from what the ring holds (batches of 8, 9, 10, 11); 100 and
    # 1-7 are unknown now, so the log claims none of them.
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({8, 9, 10, 11})}), what="the re-sync")
    assert _cleared(client, "pod-a")
    assert ingest.metric("kvingest_resyncs_total", source="pod-a", reason="ring no longer holds the gap") == 1
    vllm.publish([stored(12)])  # and it follows on
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({8, 9, 10, 11, 12})}), what="live again")


def test_several_engines_and_data_parallel_ranks_are_sources_of_their_own(
    client: OffloadClient, publishers: list[VllmStylePublisher],
    start_ingest: Callable[..., IngestProcess],
) -> None:
    a_pub, a_replay = vllm_endpoints()
    b_pub, b_replay = consecutive_endpoints()
    a = VllmStylePublisher(a_pub, a_replay)
    b0 = VllmStylePublisher(b_pub[0], b_replay[0])
    b1 = VllmStylePublisher(b_pub[1], b_replay[1], dp_rank=1)  # vLLM binds rank r at port + r
    publishers.extend([a, b0, b1])
    start_ingest(f"pod-a={a_pub},replay={a_replay}", f"pod-b={b_pub[0]},replay={b_replay[0]},dp=2")
    a.publish([stored(1)])
    b0.publish([stored(2)])
    b1.publish([stored(3), stored(4, medium="CPU")])
    want = {("pod-a", "GPU", 0): frozenset({1}), ("pod-b", "GPU", 0): frozenset({2}),
            ("pod-b-dp1", "GPU", 0): frozenset({3}), ("pod-b-dp1", "CPU", 0): frozenset({4})}
    wait_for(view_is(client, want), what="three sources")
    a.publish([BlockRemoved((1,), "GPU")])
    want.pop(("pod-a", "GPU", 0))
    wait_for(view_is(client, want), what="one engine's removal")
    assert state_of(client).violations == []


def consecutive_endpoints() -> tuple[list[str], list[str]]:
    """Pub ports p, p+1 and replay ports p+2, p+3, all free."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 3 > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + 4):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        ep = [f"tcp://127.0.0.1:{base + i}" for i in range(4)]
        return ep[:2], ep[2:]
    raise RuntimeError("no four consecutive free ports")


def test_batches_waiting_together_share_records_of_bounded_size(
    client: OffloadClient, pod_a: Callable[..., Pod],
) -> None:
    sent = [BlockStored(tuple(range(64 * i + 1, 64 * i + 65)), None, tuple(range(64 * 16)), 16, "GPU")
            for i in range(80)]  # 80 batches of 64 blocks: 1,088 values each, 87,040 in all
    pod_a(first=[[event] for event in sent])  # kv-ingest finds them all in the ring at first contact
    wait_for(lambda: sum(len(r.events) for r in records(client)) == 80, what="every batch")
    recs = records(client)
    assert [e for r in recs for e in r.events] == sent
    assert 2 <= len(recs) < 80  # merged, and split where a record would grow too big
    assert max(sum(len(e.block_hashes) + len(e.token_ids) for e in r.events  # type: ignore[union-attr]
                   ) for r in recs) <= MERGE_VALUES
