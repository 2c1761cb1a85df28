"""TorchServe's `ts` package as handlers see it (imported as `ts` inside `legacy_names()`)."""

from __future__ import annotations

__version__ = "0.12.0"
