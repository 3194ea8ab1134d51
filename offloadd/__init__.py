"""offloadd: the per-node offload daemon that owns the host tier and the event log."""
