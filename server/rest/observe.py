"""What the access log and tracing keep of each HTTP request, in one place for both ways a request
is answered: the inference routes the HTTP protocol answers itself (`protocol_cycle.py` opens an
`Observation` when it reads the head) and every other route, behind the `Observed` ASGI layer.

An observation is the request's `AccessRecord` and holds its server span (the child of the
client's `traceparent`); it is made current while the data plane runs the request (so it notes
the model, the request id and the queued jobs: server/observability/access_log.py and
tracing.py), adds `X-Request-Id` and `traceparent` to the answer's head, counts the bytes of
the answer and, once the answer is sent, writes the access line and ends the span. It is made
only while the access log or tracing is on (with both off a request pays one attribute test),
and reads no more of the request than what is on: of its headers, only the few it reads
(`OBSERVED`), which the HTTP protocol picks out in the one loop that reads the head and the
ASGI layer with `observed_headers`; a request the sampling ratio leaves out, with the access
log off, costs a scan of its head's names and a count down (`Tracing.roots_left_out`), and
nothing is kept of it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from time import perf_counter
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from scriptserve.handlers.base import new_request_id
from scriptserve.server.observability import access_log, tracing
from scriptserve.server.observability.access_log import (
    AccessLog,
    AccessRecord,
    Peer,
    usable_request_id,
)
from scriptserve.server.observability.tracing import (
    TRACEPARENT,
    TRACESTATE,
    Tracing,
    error_for_http,
)

_REQUEST_ID = b"x-request-id"
_TRACE_HEADERS = (TRACEPARENT.encode(), TRACESTATE.encode())
_TRACEPARENT = TRACEPARENT.encode()
_FORWARDED = (b"x-forwarded-for", b"x-forwarded-proto")
OBSERVED = frozenset((_REQUEST_ID, *_TRACE_HEADERS, *_FORWARDED))
"""The header names an observation reads (lower case, as the HTTP protocol gives them)."""
Headers = Sequence[tuple[bytes, bytes]]
CLIENT_GONE = 499
"""The status an access line records for a request whose client went away before its answer."""


Observe = Callable[[str, str, Headers, Peer | None, Callable[[], Scope]], "Observation | None"]
"""`Observers.observe`: the observation of a request that arrived now, given its method, path,
the headers of it named in `OBSERVED` (usually none), its peer and what makes its ASGI scope (or
what the protocol makes of a request head in that form), called only when something reads more
of it than those; None when nothing is kept of it."""


class Observers:
    """The access log and tracing of an HTTP server; `enabled` when either is on."""

    def __init__(self, access: AccessLog, tracing: Tracing) -> None:
        self.access = access
        self.tracing = tracing
        self.enabled = False
        self.observe: Observe
        """The observation of a request that arrived now: `Observation` bound to these
        observers, or `_sampled` while only tracing is on at a sampling ratio. Set by `settle`:
        the protocol's call goes straight to the observation's making, no function of ours
        between them."""
        self.ratio_only = False
        """Only tracing is on, and it samples roots at a ratio: `observe` leaves roots out
        without an observation, and the HTTP protocol need not call it for a request without
        any of the `OBSERVED` headers that the ratio leaves out (`Tracing.roots_left_out`)."""
        self.settle()

    def settle(self) -> None:
        """Derive what `observe` decides from the access log's and tracing's `enabled`: at the
        start, and again whenever either is set while serving (benchmarks/lock_in.py sets them
        on and off in one server)."""
        access, tracing = self.access, self.tracing
        self.enabled = access.enabled or tracing.enabled
        self.ratio_only = tracing.enabled and tracing.samples_roots and not access.enabled
        self.observe = self._sampled if self.ratio_only else functools.partial(Observation, self)

    def _sampled(
        self,
        method: str,
        path: str,
        observed: Headers,
        peer: Peer | None,
        scope: Callable[[], Scope],
    ) -> Observation | None:
        """`observe` while only tracing is on, at a sampling ratio: None for a request that
        carries no trace context of the client's and that the ratio leaves out (nothing is
        kept of it), else its observation."""
        for name, _ in observed:
            if name in _TRACE_HEADERS:
                return Observation(self, method, path, observed, peer, scope)
        if self.tracing.leaves_out_root():
            return None
        return Observation(self, method, path, observed, peer, scope, root_kept=True)


def observed_headers(headers: Headers) -> list[tuple[bytes, bytes]]:
    """The headers of `headers` an observation reads (`OBSERVED`)."""
    return [(name, value) for name, value in headers if name in OBSERVED]


class Observation(AccessRecord):
    """One HTTP request as the access log and tracing see it (see the module): its access
    record (written only while the access log is on: `logged`) and its span.

    `noted` says whether the data plane has anything to note in it: False for a request the
    access log does not see and the sampling ratio leaves out (an observation made outside the
    inference routes, where every request is observed while either is on).
    """

    protocol = "rest"
    status: int | str = 500
    """What the HTTP server answers when the app raises before answering."""
    trace: tracing.RequestTrace | None = None

    def __init__(
        self,
        observers: Observers,
        method: str,
        path: str,
        observed: Headers,
        peer: Peer | None,
        scope: Callable[[], Scope],
        root_kept: bool = False,
    ) -> None:
        """`observed`: the request's headers named in `OBSERVED`; `root_kept`: the sampling
        ratio was applied to this request already, and kept it. (An access record's own fields
        are set here, not by its `__init__`: one call fewer on every request.)"""
        self.started = perf_counter()
        self.method = method
        self.path = path
        self._observers = observers
        self.logged = self.noted = logged = observers.access.enabled
        made: Scope | None = None
        trace_headers: dict[str, str] | None = None
        for name, value in observed:  # usually none
            if name == _REQUEST_ID:
                self.request_id = usable_request_id(value.decode("latin-1"))
            elif name in _FORWARDED:
                if logged and made is None:
                    made = scope()
                    peer = made.get("client")
            elif name in _TRACE_HEADERS:
                if trace_headers is None:
                    trace_headers = {}
                trace_headers[name.decode("latin-1")] = value.decode("latin-1")
        self.client = peer
        tracer = observers.tracing
        if tracer.enabled and (trace_headers or root_kept or not tracer.leaves_out_root()):
            made = made or scope()
            self.trace = tracer.start(method, trace_headers or {}, _attributes(made, method))
            self.noted = True

    def run_current(self, run: Callable[[], object]) -> None:
        """Call `run` (the callback that hands the request to the data plane) with this request
        the one the data plane notes in: scheduled with `loop.call_soon`, so in the copy of the
        context it makes for every callback (no copy of our own)."""
        if self.logged:
            access_log.CURRENT.set(self)
        if self.trace is not None:
            tracing.CURRENT.set(self.trace)
        run()

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """This request the one the data plane notes in, while the block runs."""
        with access_log.opened(self if self.logged else None), tracing.opened(self.trace):
            yield

    def answered(self, status: int) -> bytes:
        """The answer starts with `status`: the header lines to add to its head, as the HTTP
        protocol writes them (`X-Request-Id` while the access log is on, `traceparent` while
        the request is traced). The bytes of the answer's body are added to `bytes_sent` as
        they go out."""
        self.status = status
        lines = b""
        if self.logged:
            if self.request_id is None:
                self.request_id = new_request_id()
            lines = b"x-request-id: %b\r\n" % self.request_id.encode()
        if self.trace is not None:
            traceparent = self._observers.tracing.traceparent(self.trace).encode()
            lines += b"traceparent: %b\r\n" % traceparent
        return lines

    def answered_pairs(self, status: int) -> list[tuple[bytes, bytes]]:
        """`answered`'s headers as an ASGI message's (name, value) pairs."""
        pairs = []
        for line in self.answered(status).split(b"\r\n"):
            if line:
                name, _, value = line.partition(b": ")
                pairs.append((name, value))
        return pairs

    def close(self, route: str | None) -> None:
        """The answer is sent (or the client went away): write the access line and end the
        span, named after `route`, the route's template, when one matched."""
        if self.logged:
            self.finish(self.status)
            self._observers.access.write(self)
        trace = self.trace
        if trace is not None and trace.recording:
            if route is not None:
                trace.name = f"{self.method} {route}"
            status = int(self.status)  # an HTTP status (a gRPC record's is a code's name)
            ended: dict[str, str | int] = {"http.response.status_code": status}
            if route is not None:
                ended["http.route"] = route
            self._observers.tracing.end(trace, ended, error_for_http(status))


class Observed:
    """An ASGI app whose every HTTP request is observed; outside the request guard, so refused
    requests are logged and traced too."""

    def __init__(self, app: ASGIApp, observers: Observers) -> None:
        self.app = app
        self.observers = observers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        observation = Observation(
            self.observers,
            scope["method"],
            scope["path"],
            observed_headers(scope["headers"]),
            scope.get("client"),
            lambda: scope,
        )

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                lines = observation.answered_pairs(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), *lines]}
            elif message["type"] == "http.response.body":
                observation.bytes_sent += len(message.get("body", b""))
            await send(message)

        with observation.opened():
            try:
                await self.app(scope, receive, observed_send)
            finally:
                observation.close(getattr(scope.get("route"), "path", None))


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    return None


_PROXY_HEADERS = ProxyHeadersMiddleware(_no_app)  # type: ignore[arg-type]


def forwarded_scope(scope: dict[str, Any]) -> dict[str, Any]:
    """`scope` with the client's address and scheme from `X-Forwarded-For` /
    `X-Forwarded-Proto` when the peer is a proxy on loopback: uvicorn's own rule, as its
    proxy-headers layer applies it in front of the ASGI apps. The layer awaits nothing but its
    app, which returns at once, so it runs to its end in one step."""
    if not any(name in _FORWARDED for name, _ in scope["headers"]):
        return scope
    step = _PROXY_HEADERS(scope, _never, _never)  # type: ignore[arg-type]
    try:
        step.send(None)
    except StopIteration:
        return scope
    step.close()
    raise RuntimeError("uvicorn's proxy-headers layer awaited something other than its app")


async def _never() -> None:
    raise RuntimeError("not called")


def _attributes(scope: Scope, method: str) -> dict[str, str | int]:
    """A request span's attributes at its start (OpenTelemetry's HTTP server conventions)."""
    attributes: dict[str, str | int] = {
        "http.request.method": method,
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": scope.get("http_version", "1.1"),
    }
    client, server = scope.get("client"), scope.get("server")
    if client:
        attributes["client.address"], attributes["client.port"] = client[0], client[1]
    if server:
        attributes["server.address"], attributes["server.port"] = server[0], server[1]
    return attributes
