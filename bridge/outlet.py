"""A PUB socket and the replay server that answers for its streams, both in one layout: the
bridge's own pair (bridge.publisher) and the legacy layout's (bridge.legacy_mirror).

The PUB is owned by the publisher's thread; the replay server runs a thread of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from bridge.config import BridgeConfig, Layout
from bridge.metrics import BridgeMetrics
from bridge.replay_server import ReplayServer, ReplaySource
from events.logreader import LogReader


@dataclass(frozen=True)
class Endpoints:
    pub: str
    replay: str


class Outlet:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        config: BridgeConfig,
        reader: LogReader,
        source: ReplaySource,
        metrics: BridgeMetrics,
        *,
        layout: Layout,
        pub_endpoint: str,
        replay_endpoint: str,
    ) -> None:
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.bind(pub_endpoint)
        try:
            self._replay = ReplayServer(ctx, config, reader, source, metrics,
                                        layout=layout, endpoint=replay_endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            raise

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(self._pub.getsockopt_string(zmq.LAST_ENDPOINT), self._replay.endpoint)

    def start(self) -> None:
        """Start answering replay and snapshot requests."""
        self._replay.start()

    def send(self, topic: bytes, seq: int, payload: bytes) -> None:
        """One batch on the PUB: ``[topic, seq, payload]`` (WIRE.md)."""
        pub = self._pub
        pub.send(topic, zmq.SNDMORE)
        pub.send(seq.to_bytes(8, "big"), zmq.SNDMORE)
        pub.send(payload)

    def stop(self) -> None:
        self._replay.stop()
        self._pub.close()
