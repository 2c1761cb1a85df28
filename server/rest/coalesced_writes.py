"""One write to the socket per answer instead of two: the HTTP server writes a response's status
line and headers as soon as the app starts it, and its body in a second call. Each write is a
`send()` system call made with the GIL held, and a packet the client wakes for: in benchmark
scenario A the two took about a third of the event loop's time.

`CoalescedWrites` wraps a connection's transport: a write is held back while nothing else is,
and goes out joined with the next write, or at the end of the event loop's current iteration
when no other write follows (a stream's last part before a pause, an answer in one piece that
someone wrote in a single call). Closing, half-closing and aborting see held bytes first.
Everything else is the wrapped transport's.

The write itself is made with `os.write` on the connection's descriptor when the transport has
nothing buffered (a plain TCP transport; TLS always goes through the transport): Python lets go of
the GIL for that system call, where uvloop's `write` holds it. On loopback the `send()` carries the
whole TCP path to the reader, and it was nearly half of the event loop's GIL-held samples in
benchmark scenario A, time the worker threads waited through to get the GIL back after a forward
pass (benchmarks/README.md has the requests a second it gained). What the socket does not take at
once (a full send buffer) goes to the transport, which buffers it and applies its flow control as
before.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any


class CoalescedWrites:
    """A transport whose writes reach `transport` in pairs where they can (see the module)."""

    __slots__ = ("_fd", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        sock = transport.get_extra_info("socket")
        plain = transport.get_extra_info("sslcontext") is None
        self._fd: int = sock.fileno() if sock is not None and plain else -1

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is None:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._held = None
        self._send(held + data)

    def flush(self) -> None:
        """Write what is held back, now."""
        held = self._held
        if held is not None:
            self._held = None
            self._send(held)

    def _send(self, data: bytes) -> None:
        transport = self._transport
        if transport.is_closing():
            return  # its descriptor may already be closed, or reused by another connection
        if self._fd >= 0 and not transport.get_write_buffer_size():
            try:
                sent = os.write(self._fd, data)  # the system call runs without the GIL
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                sent = 0  # the transport's own write meets the error and closes
            if sent == len(data):
                return
            data = data[sent:]
        transport.write(data)

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
