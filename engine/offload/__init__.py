"""The offload connector: the engine's side of the host tier held by offloadd.

Load planning and checking (lookup, view), the store queue (store), copies between the GPU cache
and the shared arena (copies, layerwise, cuda_runtime), the worker thread that talks to the
daemon (worker), config and metrics. The engine core only knows :mod:`engine.kv_connector`.
"""
