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
- a time limit for a client that stops reading the answer while the server has more to write
  (nginx `send_timeout`): the connection closes, ending a stalled stream;
- a size limit for the request line and headers together (Envoy `max_request_headers_kb`,
  answered as Envoy does: 431). Bytes are counted before the parser sees them, so an endless
  header is never buffered;
- a limit on open connections across the HTTP servers (`connection_limits.HttpConnections`):
  at the limit a new connection closes the longest-idle one; only when none is idle is it
  answered 503 and closed;
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
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from scriptserve.server.rest.coalesced_writes import CoalescedWrites

if TYPE_CHECKING:
    from scriptserve.server.rest.connection_limits import HttpConnections

log = logging.getLogger("scriptserve.rest.connections")

LINGER_S = 1.0
"""How long a connection answered with an error reads (and drops) what the client still sends."""
LINGER_BYTES = 1 << 20
"""Most bytes read and dropped while lingering; then the connection is closed at once."""
_HEAD_END = b"\r\n\r\n"
TIMER_RESOLUTION_S = 0.001
"""The event loop's timers fire up to a millisecond early (uvloop's clock counts milliseconds):
a timeout that near has passed, else its timer would be set again and again until the clock
reaches it."""


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
        self._send_timer: asyncio.TimerHandle | None = None
        self._idle = False
        self._linger_left: int | None = None
        self.requests = 0
        """Request heads read on this connection."""

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # One system call per answer, not one for the head and one for the body.
        super().connection_made(CoalescedWrites(transport, self.loop))  # type: ignore[arg-type]
        if not self.pool.admit(self):
            message = "the server has too many open connections; retry shortly"
            self._answer_and_close(503, message, b"retry-after: 1\r\n")
            return
        self._idle = True
        self._timer = self.loop.call_later(self._header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._send_timer = None
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

    def pause_writing(self) -> None:
        super().pause_writing()
        timeout = self.pool.limits.send_timeout_s
        self._send_timer = self.loop.call_later(timeout, self._send_timed_out, timeout)

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().resume_writing()

    def _send_timed_out(self, timeout_s: float) -> None:
        self._send_timer = None
        log.debug("a client read none of its answer for %g s: connection closed", timeout_s)
        self.transport.abort()

    # -- parser callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        """uvicorn's, less the request's ASGI scope (a dict of nine keys and a copy of the app
        state): the routes the protocol answers itself never read it, and a request that goes
        to an ASGI app gets it when its head is complete (`_begin_request`)."""
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_headers_complete(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._head_left = None
        self._in_body = True
        self.requests += 1
        self._begin_request()
        cycle = self.cycle
        if self.pool.draining and cycle is not None and not cycle.response_started:
            cycle.keep_alive = False

    def _begin_request(self) -> None:
        """Start the request whose head was just read: uvicorn's ASGI cycle, given the scope
        uvicorn's `on_message_begin` makes (which resets what the head's callbacks read)."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._in_body:
            self._in_body = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._head_left = self._max_head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive timeout kept by the pool (`HttpConnections.rest`)
        instead of a timer set and cancelled around every request."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request's turn
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._head_left == self._max_head:
            self._idle = True
            self.pool.rest(self)

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
        waited = self.loop.time() + TIMER_RESOLUTION_S - self._body_at
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
