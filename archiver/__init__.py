"""The scriptserve model archive: format, manifest, reading, writing and verification."""

from __future__ import annotations

__version__ = "0.1.0"
