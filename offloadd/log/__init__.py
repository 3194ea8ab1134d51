"""The daemon's durable side: the Redis log and projection (one writer), engines' event ingest
fenced by (engine, incarnation, seq), and recovery from what Redis and the arena hold."""
