"""TorchServe's `ts` package as handlers see it (imported as `ts` inside `torchserve_scope`)."""

from __future__ import annotations

__version__ = "0.12.0"
