"""Test support: real processes (Redis, our daemons) on free loopback ports."""
