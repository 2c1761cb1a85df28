"""Numbers in a panel's unit, as Grafana shows them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _number(value: float, decimals: int | None) -> str:
    if decimals is not None:
        return f"{value:.{decimals}f}"
    size = abs(value)
    text = f"{value:.{0 if size >= 100 else 1 if size >= 10 else 2}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scaled(value: float, base: float, names: Sequence[str], decimals: int | None) -> str:
    step = 0
    while abs(value) >= base and step < len(names) - 1:
        value, step = value / base, step + 1
    return f"{_number(value, decimals)}{names[step]}"


def format_value(value: float, unit: str, decimals: int | None = None) -> str:
    """`value` as Grafana shows it in `unit` (the units this dashboard uses)."""
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{_number(value * 100, decimals)}%"
    if unit == "s":
        size = abs(value)
        scale, name = (
            (1, " s") if size >= 1 or not size else (1e3, " ms") if size >= 1e-3 else (1e6, " µs")
        )
        return f"{_number(value * scale, decimals)}{name}"
    if unit == "bytes":
        return _scaled(value, 1024, (" B", " KiB", " MiB", " GiB", " TiB"), decimals)
    short = _scaled(value, 1000, ("", " K", " Mil", " Bil"), decimals)
    return f"{short} req/s" if unit == "reqps" else short
