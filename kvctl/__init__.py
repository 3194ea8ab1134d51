"""kvctl: inspect, hash, replay and verify the KV-event log. ``main`` is the console entry."""

from kvctl.main import KvctlError, main

__all__ = ["KvctlError", "main"]
