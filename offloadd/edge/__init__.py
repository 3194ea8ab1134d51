"""The daemon's gRPC edge: thin servicers (proto <-> domain, errors -> status codes) and the
server that assembles Redis, recovery, the host tier, health, reflection and metrics."""
