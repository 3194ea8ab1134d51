"""kv-bridge: republishes offloadd's log in vLLM's ZMQ wire format, with replay from the log,
snapshots and per-source streams. Entry point: ``kv-bridge`` (:mod:`bridge.main`)."""
