"""The bridge's second PUB/replay pair: the same streams in the legacy array layout.

vLLM 0.33's decoder reads the map layout; vLLM's published example subscriber still decodes
only the positional arrays of v0.23 and older (WIRE.md "Legacy layout"), and one payload
cannot satisfy both. With ``--legacy-pub``/``--legacy-replay`` one bridge serves both, so every
consumer of a fleet reads the one log: each record the publisher sends on its map-layout PUB is
sent here too, under the same topic and seq, encoded as arrays (the legacy layout carries no
source). Replay and snapshots come from a :class:`bridge.replay_server.ReplayServer` of its
own in the legacy layout, planned by the same publisher, so both pairs number alike. A record
whose values only the map layout takes (bridge.transcode) leaves its seq unsent here: legacy
consumers see a gap that replay cannot fill, and the mirror logs it.

Owned by the publisher's thread (``publish*``) except the replay server's own thread.
"""

from __future__ import annotations

import logging

import zmq

from bridge.config import BridgeConfig
from bridge.metrics import BridgeMetrics
from bridge.replay_server import ReplayServer, ReplaySource
from bridge.transcode import batch_for, relayout
from events.logreader import LogReader

log = logging.getLogger("kvbridge.legacy")


class LegacyMirror:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        config: BridgeConfig,
        reader: LogReader,
        source: ReplaySource,
        metrics: BridgeMetrics,
    ) -> None:
        assert config.legacy_pub_endpoint and config.legacy_replay_endpoint  # BridgeConfig checks
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.bind(config.legacy_pub_endpoint)
        try:
            self._replay = ReplayServer(
                ctx, config, reader, source, metrics,
                layout="legacy", endpoint=config.legacy_replay_endpoint,
            )
        except zmq.ZMQError:
            self._pub.close(linger=0)
            raise

    @property
    def endpoints(self) -> tuple[str, str]:
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT), self._replay.endpoint

    def start(self) -> None:
        self._replay.start()
        log.info("legacy layout: pub=%s replay=%s", *self.endpoints)

    def publish(self, topic: bytes, seq: int, data: bytes) -> None:
        """Send the stored record ``data`` that took ``seq`` on ``topic``'s stream."""
        batch = batch_for(data, "legacy")
        if batch is None:  # values the legacy layout's stricter decode refuses (bridge.transcode)
            log.warning("seq %d of %r cannot be encoded in the legacy layout: not sent there",
                        seq, topic.decode(errors="replace"))
            return
        self._send(topic, seq, batch.payload)

    def publish_payload(self, topic: bytes, seq: int, payload: bytes) -> None:
        """Send a batch the publisher encoded itself (a new epoch's clear batches)."""
        self._send(topic, seq, relayout(payload, "legacy"))

    def _send(self, topic: bytes, seq: int, payload: bytes) -> None:
        self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def stop(self) -> None:
        self._replay.stop()
        self._pub.close()
