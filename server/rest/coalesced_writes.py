"""One write to the socket per answer instead of two: the HTTP server writes a response's status
line and headers as soon as the app starts it, and its body in a second call. Each write is a
`send()` system call made with the GIL held, and a packet the client wakes for: in benchmark
scenario A the two took about a third of the event loop's time.

`CoalescedWrites` wraps a connection's transport: a write is held back while nothing else is,
and goes out joined with the next write, or at the end of the event loop's current iteration
when no other write follows (a stream's last part before a pause, an answer in one piece that
someone wrote in a single call). Closing, half-closing and aborting see held bytes first.
Everything else is the wrapped transport's.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescedWrites:
    """A transport whose writes reach `transport` in pairs where they can (see the module)."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is None:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._held = None
        self._transport.write(held + data)

    def flush(self) -> None:
        """Write what is held back, now."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
