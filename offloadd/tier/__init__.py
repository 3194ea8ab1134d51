"""The host tier: one owner (HostStore) of layouts, slot indexes, leases, reservations, checksums
(integrity) and the daemon's log position (source); eviction and the logged writes (Reserve,
Commit, Abort). Pure bookkeeping apart from the writes, which go through the log."""
