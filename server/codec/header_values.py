"""Numbers in HTTP header values, parsed strictly: ASCII digits only.

Python's `int()` and `float()` accept far more than HTTP allows ("²", Arabic-Indic digits,
"1_000", " 12 ", "nan", "1e3"); a header that reaches them unchecked is a 500 waiting to happen,
or a value the client did not mean.

>>> non_negative_int("42"), non_negative_int("²"), positive_seconds("0.25")
(42, None, 0.25)
"""

from __future__ import annotations

import re

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
