"""The engine's error classes: one root, and a ValueError subclass for refused requests."""


class EngineError(Exception):
    """Root of errors raised by the engine."""


class InvalidRequest(EngineError, ValueError):
    """A request was refused before it entered the engine; the message says which field and why."""
