"""Numbers in HTTP header values, parsed strictly: ASCII digits only.

Python's `int()` and `float()` accept far more than HTTP allows ("²", Arabic-Indic digits,
"1_000", " 12 ", "nan", "1e3"); a header that reaches them unchecked is a 500 waiting to happen,
or a value the client did not mean.

>>> non_negative_int("42"), non_negative_int("²"), positive_seconds("0.25")
(42, None, 0.25)
"""

from __future__ import annotations

import re

from scriptserve.server.errors import InvalidInput

_DIGITS = re.compile(r"[0-9]{1,18}")
_DECIMAL = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")


def non_negative_int(value: str) -> int | None:
    """The value as an integer, or None unless it is 1 to 18 ASCII digits."""
    return int(value) if _DIGITS.fullmatch(value) else None


def positive_seconds(value: str) -> float | None:
    """A positive number of seconds written as ASCII digits with an optional fraction, else
    None."""
    if not _DECIMAL.fullmatch(value):
        return None
    seconds = float(value)
    return seconds if seconds > 0 else None


TIMEOUT_HEADER = "X-Request-Timeout"
"""The header a client shortens its request's deadline with (HTTP; gRPC has its own)."""


def request_timeout(value: str | None) -> float | None:
    """Seconds from an `X-Request-Timeout` value (None when absent): it may shorten the
    server's deadline, never lengthen it. Raises InvalidInput when it is not a positive
    number."""
    if value is None:
        return None
    seconds = positive_seconds(value)
    if seconds is None:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a positive number of seconds, e.g. 2.5")
    return seconds
