"""`ts.metrics.dimension.Dimension`: a metric's dimension name and value."""

from __future__ import annotations


class Dimension:
    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = str(value)

    def __repr__(self) -> str:
        return f"Dimension({self.name!r}, {self.value!r})"
