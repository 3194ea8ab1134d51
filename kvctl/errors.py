"""The one error type of kvctl commands (its own module so commands and main share it)."""


class KvctlError(Exception):
    """A user-facing failure: printed as ``kvctl: error: <message>``, exit code 2."""
