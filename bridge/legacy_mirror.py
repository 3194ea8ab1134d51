"""The bridge's second PUB/replay pair: the same streams in the legacy array layout.

vLLM 0.33's decoder reads the map layout; vLLM's published example subscriber still decodes
only the positional arrays of v0.23 and older (WIRE.md "Legacy layout"), and one payload
cannot satisfy both. With ``--legacy-pub``/``--legacy-replay`` one bridge serves both, so every
consumer of a fleet reads the one log: each record the publisher sends on its map-layout PUB is
sent here too, under the same topic and seq, encoded as arrays (the legacy layout carries no
source). Replay and snapshots come from a replay server of its own in the legacy layout (its
:class:`bridge.outlet.Outlet`), planned by the same publisher, so both pairs number alike. A record
whose values only the map layout takes (bridge.transcode) leaves its seq unsent here: legacy
consumers see a gap that replay cannot fill, and the mirror logs it.

Owned by the publisher's thread (``publish*``) except the replay server's own thread.
"""

from __future__ import annotations

import logging

import zmq

from bridge.config import BridgeConfig
from bridge.metrics import BridgeMetrics
from bridge.outlet import Endpoints, Outlet
from bridge.replay_server import ReplaySource
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
        self._outlet = Outlet(ctx, config, reader, source, metrics, layout="legacy",
                              pub_endpoint=config.legacy_pub_endpoint,
                              replay_endpoint=config.legacy_replay_endpoint)

    @property
    def endpoints(self) -> Endpoints:
        return self._outlet.endpoints

    def start(self) -> None:
        self._outlet.start()
        log.info("legacy layout: pub=%s replay=%s", self.endpoints.pub, self.endpoints.replay)

    def publish(self, topic: bytes, seq: int, data: bytes) -> None:
        """Send the stored record ``data`` that took ``seq`` on ``topic``'s stream."""
        batch = batch_for(data, "legacy")
        if batch is None:  # values the legacy layout's stricter decode refuses (bridge.transcode)
            log.warning("seq %d of %r cannot be encoded in the legacy layout: not sent there",
                        seq, topic.decode(errors="replace"))
            return
        self._outlet.send(topic, seq, batch.payload)

    def publish_payload(self, topic: bytes, seq: int, payload: bytes) -> None:
        """Send a batch the publisher encoded itself (a new epoch's clear batches)."""
        self._outlet.send(topic, seq, relayout(payload, "legacy"))

    def stop(self) -> None:
        self._outlet.stop()
