"""engine: a small paged-KV inference engine that streams KV events and offloads blocks."""
