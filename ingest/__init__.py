"""kv-ingest: vLLM engines' ZMQ KV-event publishers -> offloadd's durable log (issue 19)."""
