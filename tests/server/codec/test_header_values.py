"""Numbers in header values are ASCII digits, nothing else Python's int() or float() takes."""

from __future__ import annotations

import pytest

from scriptserve.server.codec.header_values import non_negative_int, positive_seconds


@pytest.mark.parametrize("value", ["0", "7", "123456789012345678"])
def test_ascii_digits_are_numbers(value: str) -> None:
    assert non_negative_int(value) == int(value)


@pytest.mark.parametrize(
    "value",
    ["", "²", "١٢", "1_000", " 12", "12 ", "+1", "-1", "1e3", "0x10", "1234567890123456789"],
)
def test_anything_else_is_not(value: str) -> None:
    assert non_negative_int(value) is None


@pytest.mark.parametrize(("value", "seconds"), [("2", 2.0), ("0.25", 0.25), ("10.", None)])
def test_seconds(value: str, seconds: float | None) -> None:
    assert positive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["0", "0.0", "nan", "inf", "-1", "1e3", "٢", "", " 1"])
def test_seconds_must_be_positive_ascii_decimals(value: str) -> None:
    assert positive_seconds(value) is None
