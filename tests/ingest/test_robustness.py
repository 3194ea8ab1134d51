"""Garbage from a publisher is counted and logged once per kind, never fatal; health, metrics and
a graceful stop; a publisher without a replay socket."""

from __future__ import annotations

from collections.abc import Callable

from ingest.vllm_publisher import VllmStylePublisher
from offloadd.client import OffloadClient
from tests.ingest.conftest import Pod, stored, view_is, wait_for
from tests.support.ingest_proc import IngestProcess
from tests.support.offloadd_proc import DaemonProcess


def test_garbage_is_counted_logged_once_per_kind_and_never_fatal(
    client: OffloadClient, pod_a: Callable[..., Pod],
) -> None:
    pod = pod_a()
    vllm, ingest = pod.vllm, pod.ingest
    vllm.publish([stored(1)])
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({1})}), what="the first batch")
    for _ in range(3):
        vllm.send_frames([b"one frame"])
    vllm.send_frames([b"", b"123", b"payload"])  # a seq frame of 3 bytes
    vllm.send_frames([b"other-topic", (7).to_bytes(8, "big"), b"payload"])
    # A batch at the next seq that no decoder can read: its events are unknown, so the source
    # is cleared and rebuilt from what follows, and the seq goes on.
    vllm.publish_payload(b"\xc1 not msgpack")
    wait_for(view_is(client, {}), what="the source cleared")
    vllm.publish([stored(2)])
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({2})}), what="following again")
    kinds = {k: ingest.metric("kvingest_garbage_total", source="pod-a", kind=k)
             for k in ("frame_count", "seq_frame", "topic", "payload")}
    assert kinds == {"frame_count": 3, "seq_frame": 1, "topic": 1, "payload": 1}
    assert ingest.metric("kvingest_resyncs_total", source="pod-a", reason="undecodable batch") == 1
    assert ingest.output().count("(frame_count:") == 1  # logged once, counted thrice
    # The resync closed the source's stream to offloadd and the next batch opened a new one:
    # connected once its first ack is back, which the follower's next poll reports.

    def healthy() -> bool:
        code, health = ingest.health()
        return code == 200 and health["publishers"]["pod-a"]["offloadd_connected"] is True

    wait_for(healthy, timeout_s=5.0, what="healthy and connected on the new stream")
    assert ingest.proc is not None and ingest.proc.poll() is None


def test_graceful_stop_clears_the_sources_it_no_longer_follows(
    client: OffloadClient, pod_a: Callable[..., Pod], start_ingest: Callable[..., IngestProcess],
) -> None:
    pod = pod_a()
    vllm, ingest = pod.vllm, pod.ingest
    vllm.publish([stored(1), stored(2, medium="CPU")])
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({1}), ("pod-a", "CPU", 0): frozenset({2})}),
             what="both tiers")
    assert ingest.metric("kvingest_block_events_total", source="pod-a") == 2
    assert ingest.stop() == 0
    assert "stopped" in ingest.output()
    # The stream said goodbye: the daemon clears every tier of the source (its own CPU tier too).
    wait_for(view_is(client, {}), what="the source cleared")
    # A new kv-ingest rebuilds the source from the publisher's ring.
    start_ingest(pod.spec)
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({1}), ("pod-a", "CPU", 0): frozenset({2})}),
             what="rebuilt from the ring")


def test_without_a_replay_socket_a_gap_resyncs_from_what_follows(
    client: OffloadClient, pod_a: Callable[..., Pod],
) -> None:
    pod = pod_a(replay=False)
    vllm, ingest = pod.vllm, pod.ingest
    wait_for(lambda: ingest.health()[1].get("publishers", {}).get("pod-a") is not None, what="health")
    wait_for(lambda: _published_until_seen(vllm, client), what="the first batch")
    vllm.publish([stored(20)], drop=True)
    vllm.publish([stored(21)])
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({21})}), what="the re-sync")
    assert ingest.metric("kvingest_resyncs_total", source="pod-a", reason="gap without a replay socket") == 1


def _published_until_seen(vllm: VllmStylePublisher, client: OffloadClient) -> bool:
    """PUB/SUB drops what is sent before the subscription is in place: send until seen."""
    vllm.publish([stored(10)])
    return view_is(client, {("pod-a", "GPU", 0): frozenset({10})})()


def test_offloadd_down_is_unhealthy_and_nothing_is_lost_when_it_is_back(
    daemon: DaemonProcess, client: OffloadClient, pod_a: Callable[..., Pod],
) -> None:
    pod = pod_a()
    vllm, ingest = pod.vllm, pod.ingest
    vllm.publish([stored(1)])
    wait_for(view_is(client, {("pod-a", "GPU", 0): frozenset({1})}), what="the first batch")
    daemon.kill()
    vllm.publish([stored(2, parent=1)])
    vllm.publish([stored(3, parent=2)])
    wait_for(lambda: ingest.health()[0] == 503, what="unhealthy while offloadd is down")
    assert ingest.health()[1]["publishers"]["pod-a"]["offloadd_connected"] is False
    daemon.restart()  # warm: the same log
    with OffloadClient(daemon.target) as again:
        wait_for(view_is(again, {("pod-a", "GPU", 0): frozenset({1, 2, 3})}), timeout_s=20,
                 what="the batches sent while offloadd was down")
    wait_for(lambda: ingest.health()[0] == 200, what="healthy again")


def test_a_publisher_gone_past_its_lease_is_cleared_even_without_a_replay_socket(
    client: OffloadClient, publishers: list[VllmStylePublisher], pod_a: Callable[..., Pod],
) -> None:
    pod = pod_a(replay=False, extra=("--publisher-lease-s", "0.5"))
    vllm, ingest = pod.vllm, pod.ingest
    wait_for(lambda: _published_until_seen(vllm, client), what="the first batch")
    vllm.close()  # the pod is gone: its GPU cache with it
    wait_for(view_is(client, {}), what="the source cleared after the lease")
    assert ingest.metric("kvingest_resyncs_total", source="pod-a", reason="publisher unreachable") == 1
    vllm = VllmStylePublisher(pod.pub)  # a new pod on the same address
    publishers.append(vllm)
    wait_for(lambda: _published_until_seen(vllm, client), what="the new life followed")
