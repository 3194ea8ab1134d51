"""kvcache.v1: the gRPC contract of kvoffload (generated code; see scripts/gen_proto.py)."""
