"""The closed-loop client that counts every request's outcome through haproxy."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from dataclasses import dataclass
from types import TracebackType
from typing import cast

import httptools
import uvloop


@dataclass(frozen=True)
class Outcome:
    done_s: float
    """When the answer (or the error) came, in seconds since the load started."""
    kind: str
    """succeeded (a 200), failed (another status) or unanswered (a timeout, a lost connection)."""
    detail: str
    """The status code or the exception's name."""


class _Connection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection carrying one request at a time. Answers are parsed by
    httptools (llhttp, the parser the server runs too): a client in Python that builds request
    objects (httpx) tops out near 900 req/s on this machine, below what two replicas serve."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[tuple[int, bool]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._settle(exc)
            self.close()

    def on_message_complete(self) -> None:  # the parser's callback
        self._settle((self.parser.get_status_code(), self.parser.should_keep_alive()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._settle(exc or ConnectionResetError("closed before the answer was complete"))

    def _settle(self, result: tuple[int, bool] | Exception) -> None:
        if self.answer is None or self.answer.done():
            return
        if isinstance(result, Exception):
            self.answer.set_exception(result)
        else:
            self.answer.set_result(result)

    async def exchange(self, request: bytes) -> tuple[int, bool]:
        """Send `request` (all of it, in one write); the answer's status and whether the
        connection stays open."""
        if self.transport is None:
            raise ConnectionResetError("the connection is closed")
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.answer

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class CountingLoad:
    """Closed-loop POSTs of `body` to `url` from `connections` workers, each with one request
    outstanding on its own keep-alive connection, on an event loop in a thread of its own;
    every request's outcome is kept. `stop()` lets each worker finish the request it has in
    flight, so none is cut off."""

    def __init__(self, url: str, body: bytes, connections: int, timeout_s: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.request = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.connections, self.timeout_s = connections, timeout_s
        self.outcomes: list[Outcome] = []
        self.started = 0.0
        self.duration_s = 0.0
        self.cpu_s = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.started

    def __enter__(self) -> CountingLoad:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending, wait for the requests in flight; raises what broke the client."""
        self._stop.set()
        self._thread.join(self.timeout_s + 10)
        error, self.error = self.error, None  # raised once, not again by __exit__
        if error is not None:
            raise RuntimeError("the load generator failed") from error

    def _main(self) -> None:
        try:
            uvloop.run(self._run())
        except BaseException as exc:  # handed to the main thread by stop()
            self.error = exc

    async def _run(self) -> None:
        cpu = time.thread_time()
        await asyncio.gather(*(self._worker() for _ in range(self.connections)))
        self.duration_s = self.now()
        self.cpu_s = time.thread_time() - cpu

    async def _connect(self) -> _Connection:
        connect = asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        _, connection = await asyncio.wait_for(connect, self.timeout_s)
        return connection

    async def _worker(self) -> None:
        connection: _Connection | None = None
        while not self._stop.is_set():
            try:
                if connection is None or connection.transport is None:
                    connection = await self._connect()
                answer = connection.exchange(self.request)
                status, keep_alive = await asyncio.wait_for(answer, self.timeout_s)
            except (OSError, asyncio.TimeoutError, httptools.HttpParserError) as exc:
                # Refused, reset, closed early, timed out or garbled: no answer to count.
                self.outcomes.append(Outcome(self.now(), "unanswered", type(exc).__name__))
                if connection is not None:
                    connection.close()
                connection = None
                continue
            kind = "succeeded" if status == 200 else "failed"
            self.outcomes.append(Outcome(self.now(), kind, str(status)))
            if not keep_alive:
                connection.close()
                connection = None
        if connection is not None:
            connection.close()
