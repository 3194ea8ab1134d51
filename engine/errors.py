"""The engine's error classes: one root for the engine package, and a ValueError subclass for
refused requests. The engine's other errors derive from the root where they are raised
(``engine.block_pool.NoFreeBlocks``, ``engine.offload.cuda_runtime.BatchUnsupportedError``,
``engine.model.config.ModelConfigError``), so a
caller can catch everything the engine raises on purpose with ``except EngineError``."""


class EngineError(Exception):
    """Root of errors raised by the engine."""


class InvalidRequest(EngineError, ValueError):
    """A request was refused before it entered the engine; the message says which field and why."""


class EngineStopped(EngineError):
    """The engine is shutting down: a new request is refused, one in flight ends with this.
    Worth a retry on another engine (gRPC UNAVAILABLE, HTTP 503)."""
