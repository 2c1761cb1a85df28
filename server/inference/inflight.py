"""The requests in flight, counted per model version (and pipeline): what the data plane's
`Call` enters and leaves, what management's describe reports, and what drain waits on."""

from __future__ import annotations

import asyncio


class InFlight:
    """The count of requests in flight per (model, version), and the moment it reaches zero."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def total(self) -> int:
        """Requests in flight across every model."""
        return sum(self._counts.values())

    def of(self, name: str, version: str) -> int:
        return self._counts.get((name, version), 0)

    def arrive(self, name: str, version: str) -> None:
        """A request to the model version (or the pipeline) `name` `version` is in flight."""
        key = (name, version)
        self._counts[key] = self._counts.get(key, 0) + 1
        self._idle.clear()

    def depart(self, name: str, version: str) -> None:
        key = (name, version)
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]
            if not self._counts:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most `timeout_s`; True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
