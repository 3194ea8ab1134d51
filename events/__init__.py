"""events: the leaf library. Schema, block hashing, codecs (protobuf, vLLM msgpack, JSON lines),
log records and the log reader, the one CacheState reducer, and the subscriber (the client side of
the bridge's wire). Imports no torch, grpc, redis or prometheus; zmq only in the subscriber and
its replay socket."""
