"""One request of the inference routes the HTTP protocol answers itself (`protocol_routes.py`):
its head read, its body collected from the parser's callbacks, the guard's checks, and its
answer written; observed by the access log and tracing while either is on. What a route does
with the whole request (its hand-over to the data plane) and how its answer is made are the
route's own: `route_cycles.py`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from scriptserve.server.codec.header_values import TIMEOUT_HEADER, request_timeout
from scriptserve.server.errors import PayloadTooLarge, ServingError
from scriptserve.server.rest.errors import body_too_large, error_body, method_not_allowed
from scriptserve.server.rest.observe import CLIENT_GONE, OBSERVED, Observation, forwarded_scope

if TYPE_CHECKING:
    from scriptserve.server.rest.protocol_routes import (
        InferenceHttpProtocol,
        InferenceRoute,
        ProtocolRoutes,
    )

log = logging.getLogger("scriptserve.rest")

_TIMEOUT = TIMEOUT_HEADER.lower().encode()
_FRAMING = frozenset(("content-length", "transfer-encoding", "connection"))
"""Answer headers the protocol writes itself; a handler's own are dropped."""
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON = b"application/json"


class ProtocolCycle(RequestResponseCycle):
    """One request of the inference routes, from its head to its answer (see `protocol_routes`);
    a route's own class (`route_cycles.py`) hands the whole request over in `_run`.

    uvicorn's protocol sees a RequestResponseCycle: it appends the body, sets `more_body` and
    `disconnected`, and calls `message_event.set()`, which is this object's `set`. The parent's
    constructor is not called: it makes an asyncio.Event and needs an ASGI scope, neither of
    which is used here.
    """

    def __init__(  # noqa: PLR0915  (the head read in one pass: a helper is a call a request)
        self,
        protocol: InferenceHttpProtocol,
        routes: ProtocolRoutes,
        method: str,
        path: str,
        route: InferenceRoute,
        model_name: str,
        version: str | None,
    ) -> None:
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.default_headers = protocol.server_state.default_headers
        self.on_response = protocol.on_response_complete
        self._loop = protocol.loop
        self._tasks = protocol.tasks
        self.routes = routes
        self.method = method
        self.path = path
        self.route = route
        self.model_name = model_name
        self.version = version
        parser = protocol.parser
        self.keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        self.waiting_for_100_continue = protocol.expect_100_continue
        self.disconnected = False
        self.body = bytearray()
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.begun = False
        self.running = False
        self._withdraw: Callable[[], Any] | None = None
        self.raw_headers = protocol.headers
        self.content_type: str | None = None
        self.declared: int | None = None
        self.authorization: str | None = None
        self.timeout: str | None = None
        self.timeout_s: float | None = None
        """The deadline the client asks for (`X-Request-Timeout`), read when its turn begins."""
        self.header_length: str | None = None
        observing = routes.observers.enabled
        observed: list[tuple[bytes, bytes]] = []  # what an observation reads, while one is made
        for name, value in protocol.headers:
            if name == b"content-type":
                self.content_type = value.decode("latin-1")
            elif name == b"content-length":
                self.declared = int(value) if value.isdigit() else None
            elif name == b"authorization":
                self.authorization = value.decode("latin-1")
            elif name == _TIMEOUT:
                self.timeout = value.decode("latin-1")
            elif name == b"inference-header-content-length":
                self.header_length = value.decode("latin-1")
            elif observing and name in OBSERVED:
                observed.append((name, value))
        self.observation: Observation | None = None
        """The request's observation, while the access log or tracing is on and sees it."""
        if observing:
            observers = routes.observers
            tracer = observers.tracing
            if not observed and observers.ratio_only and tracer.roots_left_out:
                tracer.roots_left_out -= 1  # the ratio leaves it out, and nothing else sees it
            else:
                self._protocol = protocol
                self.observation = observers.observe(
                    method, path, observed, protocol.client, self._scope
                )

    def _scope(self) -> dict[str, Any]:
        """What the access log and tracing read of the request head, as an ASGI scope has it,
        with the client and scheme a loopback proxy forwards (made only when they read it)."""
        protocol = self._protocol
        scope = {
            "type": "http",
            "method": self.method,
            "path": self.path,
            "headers": protocol.headers,
            "client": protocol.client,
            "server": protocol.server,
            "scheme": protocol.scheme,
            "http_version": protocol.parser.get_http_version(),
        }
        return forwarded_scope(scope)

    @property
    def message_event(self) -> ProtocolCycle:  # type: ignore[override]
        """What uvicorn's protocol calls `set` on: this cycle (a property, not an attribute
        holding itself, so that a finished cycle is freed at once, not by the cycle collector)."""
        return self

    # -- what the protocol calls --------------------------------------------------------------
    def begin(self) -> None:
        """The request's turn on its connection (at once, or after the pipelined ones before
        it): refuse it now if its key, method, declared size or deadline says so, else wait for
        its body."""
        self.begun = True
        routes = self.routes
        if routes.auth:
            error = routes.keys.check("inference", self.authorization)
            if error is not None:
                self._answer_error(error)
                return
        if self.method not in self.route.methods:
            self._answer_error(method_not_allowed(self.method, ", ".join(self.route.methods)))
            return
        if self.declared is not None and self.declared > routes.max_bytes:
            self._answer_error(body_too_large(routes.max_bytes))
            return
        if self.timeout is not None:
            try:
                self.timeout_s = request_timeout(self.timeout)
            except ServingError as exc:
                self._answer_error(exc)
                return
        if self.waiting_for_100_continue and self.more_body:
            self.waiting_for_100_continue = False
            self.transport.write(_CONTINUE)
        if not self.more_body:
            self._ready()

    def body_part(self, data: bytes) -> None:
        """Bytes of the body, from the parser."""
        if self.response_complete:
            return  # answered already (refused): the rest of the body is dropped
        self.body += data
        if self.declared is None and len(self.body) > self.routes.max_bytes:
            self._answer_error(body_too_large(self.routes.max_bytes))

    def set(self) -> None:
        """uvicorn's `message_event.set()`: the body ended, or the client went away."""
        if self.disconnected:
            self._gone()
        elif self.begun and not (self.more_body or self.running or self.response_complete):
            self._ready()

    def clear(self) -> None:
        """uvicorn's `message_event.clear()`: nothing to do."""

    # -- the request --------------------------------------------------------------------------
    def _ready(self) -> None:
        """The whole request is in: hand it to the data plane at the end of this turn of the
        event loop, once every connection with bytes to read has been read. Queued in one
        burst, the turn's requests are batched together, where handing each over as it is
        parsed wakes a worker for the first one alone (fewer requests a second on OIP's binary
        route: benchmarks/README.md). An observed request runs with
        its observation current, where the data plane notes what the access log and tracing
        record."""
        self.running = True
        observation = self.observation
        if observation is None or not observation.noted:
            self._loop.call_soon(self._run)
        else:
            self._loop.call_soon(observation.run_current, self._run)

    def _run(self) -> None:
        """Hand the whole request to the data plane; its answer comes back to this cycle. Each
        route's class has its own (`route_cycles.py`). (Not an `abc.ABC`: the protocol checks
        `isinstance` on every request, which an ABC's metaclass makes about five times slower.)"""
        raise NotImplementedError(f"{type(self).__name__} hands no request over")

    def _headers(self) -> Headers:
        return Headers(raw=self.raw_headers)

    def _gone(self) -> None:
        """The client went away: withdraw its request (the data plane frees its slot)."""
        if self.running:
            if self._withdraw is not None:
                self._withdraw()
        elif self.begun and self.more_body and not self.response_complete:
            self.routes.disconnected(self.method, self.route.template)
        if not self.response_complete:
            self.response_complete = True
            if self.observation is not None:
                if not self.response_started:
                    self.observation.status = CLIENT_GONE
                self._observed_end()

    # -- writing ------------------------------------------------------------------------------
    def _head(
        self,
        status: int,
        content_type: bytes,
        headers: dict[str, str] | None = None,
        lines: bytes = b"",
    ) -> bytes:
        """The answer's head up to its framing; `headers` are a handler's own (checked here),
        `lines` header lines the protocol writes itself."""
        self.response_started = True
        self.waiting_for_100_continue = False
        head = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(lines)
        if self.observation is not None:
            head.append(self.observation.answered(status))
        for key, text in (headers or {}).items():
            lower = key.lower()
            name, value = lower.encode("latin-1"), text.encode("latin-1")
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                raise ValueError(f"the answer header {key!r} is not a valid HTTP header")
            if lower == "content-type":
                content_type = value  # the handler's own, as Starlette's Response takes it
            elif lower not in _FRAMING:
                head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: ", content_type, b"\r\n"]
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        return b"".join(head)

    def _answer(
        self,
        status: int,
        payload: bytes,
        content_type: bytes,
        headers: dict[str, str] | None = None,
        lines: bytes = b"",
    ) -> None:
        if self.response_complete:
            return
        try:
            head = self._head(status, content_type, headers, lines)
        except ValueError:
            self.response_started = False
            self._unexpected()
            return
        size = len(payload)
        if self.method == "HEAD":  # a 405: the head says what the body would be
            payload = b""
        elif self.observation is not None:
            self.observation.bytes_sent += size
        self.transport.write(b"%scontent-length: %d\r\n\r\n%s" % (head, size, payload))
        self._complete()

    def _answer_error(self, error: ServingError) -> None:
        if isinstance(error, PayloadTooLarge):
            self.keep_alive = False  # the rest of the body is never read
        self._answer(error.status, error_body(self.path, error), _JSON, error.headers)

    def _unexpected(self) -> None:
        log.exception(
            "model=%s version=%s: unexpected failure", self.model_name, self.version or "default"
        )
        self._answer_error(ServingError("internal server error; see the server log"))

    def _complete(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        if self.observation is not None:
            self._observed_end()
        on_response, self.on_response = self.on_response, _nothing
        on_response()

    def _observed_end(self) -> None:
        """The access line and the span's end, once: the answer is sent or the client gone."""
        observation, self.observation = self.observation, None
        if observation is not None:
            observation.close(self.route.template)


def _nothing() -> None:
    pass
