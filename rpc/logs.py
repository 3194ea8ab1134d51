"""Structured logs: one JSON object per line on stderr (ts, level, logger, msg, extra fields).

Secrets (the bearer token, the Redis password) are masked in every line, whatever logged them
(an exception message, a library's repr), and :func:`redact_url` hides the password of a URL
before anything prints it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
MASK = "***"
MIN_MASKED = 4


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0`` (no password:
    unchanged; a lone ``redis://secret@host`` is taken as a password, as redis-py does)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # unparseable: it may be all secret
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, has_password, _password = userinfo.partition(":")
    shown = f"{user}:{MASK}" if has_password else MASK
    return urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))


def url_secrets(url: str) -> tuple[str, ...]:
    """The password in ``url`` as written and decoded, for masking; () when there is none."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return ()
    userinfo = parts.netloc.rpartition("@")[0]
    if not userinfo:
        return ()
    # A lone user part (redis://secret@host) is masked too: it is often a password.
    raw = userinfo.partition(":")[2] if ":" in userinfo else userinfo
    return tuple({raw, unquote(raw)} - {""})


class JsonFormatter(logging.Formatter):
    def __init__(self, secrets: Sequence[str] = ()) -> None:
        super().__init__()
        # Shorter strings would mask ordinary words; such a password is no protection anyway.
        self.secrets = tuple(s for s in secrets if len(s) >= MIN_MASKED)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        line = json.dumps(out, default=str)
        for secret in self.secrets:
            line = line.replace(secret, MASK).replace(json.dumps(secret)[1:-1], MASK)
        return line


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """A --log-level value as a level name (any case accepted), for argparse's ``type=``: a
    bad one is a usage error naming the choices, not a traceback from logging."""
    level = str(text).strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (any case), got {text!r}")
    return level


def setup_logging(level: str, secrets: Sequence[str] = ()) -> None:
    """JSON lines on stderr; every string in ``secrets`` is masked wherever it appears."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime
