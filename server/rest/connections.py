"""HTTP connections bounded in time, size and number, and closed cleanly while the server drains.

uvicorn's httptools protocol reads a request head and body with no time limit, takes a head of
any size, and accepts connections until the process runs out of file descriptors.
`LimitedHttpProtocol` subclasses it (uvicorn.Config's `http=`; nothing in uvicorn is patched)
and adds, after nginx and Envoy:

- a time limit for the request line and headers (nginx `client_header_timeout`): from
  connection open on a new connection, from the first byte of the next head on a keep-alive
  one (until then uvicorn's keep-alive timeout applies). 408 when part of a request arrived, a
  plain close when nothing did;
- a time limit for the body, as idle time between two reads (nginx `client_body_timeout`): 408
  when the app has not answered yet, else a close;
- a size limit for the request line and headers together (Envoy `max_request_headers_kb`,
  answered as Envoy does: 431). Bytes are counted before the parser sees them, so an endless
  header is never buffered;
- a limit on open connections across the HTTP servers: at the limit a new connection closes
  the longest-idle one (a keep-alive connection between requests, or one that has sent
  nothing yet); only when none is idle is it answered 503 and closed;
- while the server drains, `Connection: close` on every response that starts, so no client
  sends another request on a connection that is about to close.

Timers are per connection and only when a head or body spans reads: a keep-alive request whose
head and body arrive in one read costs no timer. Error answers are written by the protocol
(no app is involved), then the connection lingers (nginx `lingering_close`): the write side is
shut, and what the client still sends is read and dropped for a moment, so that the answer is
not lost to a reset before the client reads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

if TYPE_CHECKING:
    from scriptserve.server.settings import ServerSettings

log = logging.getLogger("scriptserve.rest.connections")

LINGER_S = 1.0
"""How long a connection answered with an error reads (and drops) what the client still sends."""
LINGER_BYTES = 1 << 20
"""Most bytes read and dropped while lingering; then the connection is closed at once."""
FD_RESERVE = 256
"""File descriptors kept for everything but HTTP connections (models, workers, gRPC, logs)."""
_HEAD_END = b"\r\n\r\n"
_REFUSAL_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits every HTTP connection of the process is held to."""

    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_connections: int

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ConnectionLimits:
        return cls(
            header_timeout_s=settings.http_header_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            max_header_bytes=settings.http_max_header_bytes,
            max_connections=connection_budget(settings.http_max_connections),
        )


def connection_budget(requested: int) -> int:
    """`requested`, or fewer where the open-file limit would run out first: without that
    headroom, accept() fails once the process has no descriptor left, and nothing is served."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    budget = max(soft // 2, soft - FD_RESERVE)
    if requested <= budget:
        return requested
    log.warning(
        "http_max_connections %d would exhaust the open-file limit (%d): using %d; raise the "
        "limit (ulimit -n) to allow more",
        requested, soft, budget,
    )  # fmt: skip
    return budget


class HttpConnections:
    """The HTTP connections of the process: the open ones, the idle ones in the order they
    became idle, and whether the server drains. One instance serves every HTTP server, so idle
    connections on one port cannot starve another.

        connections = HttpConnections(ConnectionLimits.from_settings(settings))
        uvicorn.Config(app, http=connections.protocol_class())
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: set[LimitedHttpProtocol] = set()
        self.idle: dict[LimitedHttpProtocol, None] = {}
        """Idle connections, oldest first (a dict keeps insertion order)."""
        self.draining = False
        self._all_closed = asyncio.Event()
        self._refused = 0
        self._refusal_logged_at = -_REFUSAL_LOG_INTERVAL_S

    def protocol_class(self) -> type[LimitedHttpProtocol]:
        """The protocol class to give uvicorn.Config as `http=`, bound to these connections."""
        connections = self

        class BoundHttpProtocol(LimitedHttpProtocol):
            pool = connections

        return BoundHttpProtocol

    def admit(self, connection: LimitedHttpProtocol) -> bool:
        """Count a new connection in, closing the longest-idle one if the limit is reached;
        False when the limit is reached and no connection is idle."""
        if len(self.open) >= self.limits.max_connections:
            if not self.idle:
                self._log_refusal()
                return False
            oldest = next(iter(self.idle))
            log.debug("connection limit reached: closing the longest-idle connection")
            self.forget(oldest)
            oldest.transport.close()
        self.open.add(connection)
        self.idle[connection] = None
        return True

    def forget(self, connection: LimitedHttpProtocol) -> None:
        self.open.discard(connection)
        self.idle.pop(connection, None)
        if self.draining and not self.open:
            self._all_closed.set()

    def drain(self) -> None:
        """From now on every response that starts carries `Connection: close`."""
        self.draining = True
        for connection in list(self.open):
            connection.close_after_response()
        if not self.open:
            self._all_closed.set()

    def close_idle(self) -> None:
        """Close the keep-alive connections waiting between requests. One that has not sent its
        first request yet is left to send it (it was accepted, its client is sending) or to
        reach the header timeout."""
        for connection in list(self.idle):
            if connection.requests:
                self.forget(connection)
                connection.transport.close()

    async def wait_closed(self, timeout_s: float) -> bool:
        """Wait (while draining) until no connection is open; False at the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.open:
            self._all_closed.clear()
            try:
                await asyncio.wait_for(self._all_closed.wait(), deadline - loop.time())
            except TimeoutError:
                return False
        return True

    def _log_refusal(self) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "%d connection(s) answered 503: http_max_connections (%d) are open and none "
                "is idle",
                self._refused, self.limits.max_connections,
            )  # fmt: skip
            self._refused = 0
            self._refusal_logged_at = now


def _error_body(status: int, message: str) -> bytes:
    kind = HTTPStatus(status).phrase.replace(" ", "")
    return json.dumps({"code": status, "type": kind, "message": message}).encode()


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `HttpConnections` (see the module)."""

    pool: ClassVar[HttpConnections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limits = self.pool.limits
        self._max_head = limits.max_header_bytes
        self._header_timeout_s = limits.header_timeout_s
        self._body_timeout_s = limits.body_timeout_s
        self._head_left: int | None = self._max_head
        """Bytes the request head being read may still take; None once the headers are in."""
        self._in_body = False
        self._body_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._idle = False
        self._linger_left: int | None = None
        self.requests = 0
        """Request heads read on this connection."""

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.pool.admit(self):
            message = "the server has too many open connections; retry shortly"
            self._answer_and_close(503, message, b"retry-after: 1\r\n")
            return
        self._idle = True
        self._timer = self.loop.call_later(self._header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.pool.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_left is not None:
            self._drop(len(data))
            return
        if self._idle:
            self._idle = False
            self.pool.idle.pop(self, None)
        left = self._head_left
        if left is not None:
            size = len(data)
            if size > left and data.find(_HEAD_END, 0, left) < 0:
                self._feed_over_budget(data, left)
            else:
                self._head_left = left - size
                super().data_received(data)
        else:
            super().data_received(data)
        if self._timer is not None:
            if self._in_body:
                self._body_at = self.loop.time()
        elif (
            self._in_body or (self._head_left is not None and self._head_left < self._max_head)
        ) and not self.transport.is_closing():
            self._arm_timer()

    def _feed_over_budget(self, data: bytes, left: int) -> None:
        """A read longer than the head may still be: feed only what the head may take; the
        rest follows only if the headers ended within it."""
        heads = self.requests
        self._head_left = 0
        if left:
            super().data_received(data[:left])
            if self.transport.is_closing():
                return
        if self.requests > heads:  # the headers ended within the budget (split "\r\n\r\n")
            self.data_received(data[left:])
            return
        log.debug("request head over %d bytes: answered 431", self._max_head)
        self._answer_and_close(
            431,
            f"the request line and headers are larger than the server's limit of "
            f"{self._max_head} bytes",
        )

    def _arm_timer(self) -> None:
        """A head or a body is incomplete at the end of a read: time the rest."""
        if self._in_body:
            self._body_at = self.loop.time()
            self._timer = self.loop.call_later(self._body_timeout_s, self._body_timed_out)
        else:
            self._timer = self.loop.call_later(self._header_timeout_s, self._header_timed_out)

    # -- parser callbacks ------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._head_left = None
        self._in_body = True
        self.requests += 1
        super().on_headers_complete()
        cycle = self.cycle
        if self.pool.draining and cycle is not None and not cycle.response_started:
            cycle.keep_alive = False

    def on_message_complete(self) -> None:
        if self._in_body:
            self._in_body = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._head_left = self._max_head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if (
            not self.transport.is_closing()
            and not self.pipeline
            and self._head_left == self._max_head
        ):
            self._idle = True
            self.pool.idle[self] = None

    def close_after_response(self) -> None:
        """The server drains: responses not started yet carry `Connection: close`; a response
        already on its way keeps what it said, and its connection closes once idle."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.keep_alive = False
        for queued, _ in self.pipeline:
            queued.keep_alive = False

    def _unsupported_upgrade_warning(self) -> None:
        # The apps serve no WebSocket (uvicorn runs with ws="none"): an Upgrade header is
        # the client's business and the request is served as plain HTTP.
        log.debug("ignored an Upgrade request header")

    # -- timeouts --------------------------------------------------------------------------
    def _header_timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._head_left is None:
            return
        if self.flow.read_paused:  # uvicorn holds the read back (pipelining), not the client
            self._timer = self.loop.call_later(self._header_timeout_s, self._header_timed_out)
            return
        if self._head_left == self._max_head and self.cycle is None:
            log.debug("connection sent nothing within %g s: closed", self._header_timeout_s)
            self.pool.forget(self)
            self.transport.close()
            return
        log.debug("request head incomplete after %g s: answered 408", self._header_timeout_s)
        self._answer_and_close(
            408,
            f"the request line and headers did not arrive within {self._header_timeout_s:g} s",
        )

    def _body_timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing() or not self._in_body:
            return
        waited = self.loop.time() - self._body_at
        if self.flow.read_paused or waited < self._body_timeout_s:
            # Paused: the app has not taken what arrived yet, the client is not to blame.
            delay = self._body_timeout_s if self.flow.read_paused else self._body_timeout_s - waited
            self._timer = self.loop.call_later(delay, self._body_timed_out)
            return
        cycle = self.cycle
        if cycle.response_started:
            self.transport.close()  # the answer is out; only the rest of the body is missing
            return
        # The app waits in receive(): it gets http.disconnect, and nothing it sends goes out.
        cycle.disconnected = True
        cycle.message_event.set()
        log.debug("request body stalled for %g s: answered 408", self._body_timeout_s)
        self._answer_and_close(
            408, f"the request body stalled: no bytes for {self._body_timeout_s:g} s"
        )

    # -- answers from the protocol itself --------------------------------------------------
    def _answer_and_close(self, status: int, message: str, extra_headers: bytes = b"") -> None:
        body = _error_body(status, message)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
            extra_headers,
            b"\r\n",
            body,
        ]
        self.transport.write(b"".join(head))
        self._linger()

    def _linger(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.pool.idle.pop(self, None)
        self._idle = False
        self._in_body = False
        self._linger_left = LINGER_BYTES
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer, then FIN; what follows is read and dropped
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _drop(self, size: int) -> None:
        assert self._linger_left is not None
        self._linger_left -= size
        if self._linger_left <= 0:
            self.transport.close()
