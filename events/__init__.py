"""events: schema, codecs, block hashing, the CacheState reducer, the log reader, the ZMQ bridge, the subscriber library and kvctl. Imports no torch, grpc or redis."""
