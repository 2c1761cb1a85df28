"""The HTTP connections of the process as a whole: their limits, the open and idle ones, and
whether the server drains (`server/rest/connections.py` holds one connection's protocol).

A keep-alive connection idle for `http_keepalive_timeout_s` is closed by one timer for them all,
set for the longest-idle one, where uvicorn sets and cancels a timer of its own after every
answer, a cost on the event loop for every request.

At the limit on open connections (across the HTTP servers), a new connection closes the
longest-idle one (a keep-alive connection between requests, or one that has sent nothing
yet); only when none is idle is it answered 503 and closed. The limit stays below the process's
open-file limit, so that accept() never fails for want of a descriptor.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scriptserve.server.rest.connections import TIMER_RESOLUTION_S, LimitedHttpProtocol
from scriptserve.server.rest.protocol_routes import InferenceHttpProtocol, ProtocolRoutes

if TYPE_CHECKING:
    from scriptserve.server.settings import ServerSettings

log = logging.getLogger("scriptserve.rest.connections")

FD_RESERVE = 256
"""File descriptors kept for everything but HTTP connections (models, workers, gRPC, logs)."""
_REFUSAL_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits every HTTP connection of the process is held to."""

    header_timeout_s: float
    keepalive_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float
    max_header_bytes: int
    max_connections: int

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ConnectionLimits:
        return cls(
            header_timeout_s=settings.http_header_timeout_s,
            keepalive_timeout_s=settings.http_keepalive_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            send_timeout_s=settings.http_send_timeout_s,
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
        requested,
        soft,
        budget,
    )
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
        self.idle: dict[LimitedHttpProtocol, float] = {}
        """Idle connections, oldest first (a dict keeps insertion order), with the event loop's
        time at which each became idle."""
        self._sweep: asyncio.TimerHandle | None = None
        """The timer that closes the keep-alive connections idle too long, while one is set."""
        self.draining = False
        self._all_closed = asyncio.Event()
        self._refused = 0
        self._refusal_logged_at = -_REFUSAL_LOG_INTERVAL_S

    def protocol_class(self, routes: ProtocolRoutes | None = None) -> type[LimitedHttpProtocol]:
        """The protocol class to give uvicorn.Config as `http=`, bound to these connections;
        with `routes`, one that answers the inference routes itself (`protocol_routes`)."""
        connections = self
        if routes is not None:

            class BoundInferenceProtocol(InferenceHttpProtocol):
                pool = connections

            BoundInferenceProtocol.routes = routes
            return BoundInferenceProtocol

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
        self.idle[connection] = connection.loop.time()  # the header timeout closes it if silent
        return True

    def rest(self, connection: LimitedHttpProtocol) -> None:
        """`connection` answered its requests and waits for the next: closed once it has waited
        the keep-alive timeout."""
        loop = connection.loop
        self.idle.pop(connection, None)  # at the end: the dict stays in the order they went idle
        self.idle[connection] = loop.time()
        if self._sweep is None:
            self._sweep = loop.call_later(self.limits.keepalive_timeout_s, self._close_stale, loop)

    def _close_stale(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the keep-alive connections idle for the timeout; set the timer again for the
        longest-idle one left. A connection that has not sent its first request is left to the
        header timeout."""
        self._sweep = None
        limit = self.limits.keepalive_timeout_s
        now = loop.time() + TIMER_RESOLUTION_S
        stale: list[LimitedHttpProtocol] = []
        next_at: float | None = None
        for connection, since in self.idle.items():
            if now - since < limit:
                next_at = since + limit
                break
            if connection.requests:
                stale.append(connection)
        for connection in stale:
            self.forget(connection)
            if not connection.transport.is_closing():
                connection.transport.close()
        if next_at is not None:
            self._sweep = loop.call_at(next_at, self._close_stale, loop)

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
                self._refused,
                self.limits.max_connections,
            )
            self._refused = 0
            self._refusal_logged_at = now
