"""Every error the events library raises derives from EventsError, keeping its old base."""

from __future__ import annotations

import pytest

from events.errors import EventsError
from events.logreader import LogUnavailable
from events.records import decode_record
from events.schema import SchemaError
from events.subscriber import SubscriberError
from events.wire_frames import BadRequest, parse_request


def test_error_root_and_bases() -> None:
    for cls in (SchemaError, LogUnavailable, SubscriberError, BadRequest):
        assert issubclass(cls, EventsError), cls
    assert issubclass(SchemaError, ValueError) and issubclass(BadRequest, ValueError)


def test_raised_errors_are_caught_by_the_root() -> None:
    with pytest.raises(EventsError):
        decode_record(b"\x01")
    with pytest.raises(EventsError):
        parse_request([b"id", b"x", b"snapshot"])
