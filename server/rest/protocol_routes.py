"""The inference routes answered from the HTTP protocol's own callbacks, without ASGI.

Through uvicorn, each request is an ASGI cycle: a scope, an `asyncio.Event`, a task running a
coroutine through the request guard and `hot_routes.HotRoutes`, a `Request` and a `Response`
object, and two `send` messages whose headers uvicorn validates one by one. For the four routes
that carry nearly every request a server answers (`/predictions/{model}[/{version}]`, POST and
PUT, and `/v2/models/{model}[/versions/{version}]/infer`) that is most of the event loop's
Python time. `InferenceHttpProtocol` serves them itself: when a request head names one of them,
it makes a `ProtocolCycle` (`protocol_cycle.py`; a uvicorn `RequestResponseCycle`, so
keep-alive, pipelining, flow control, the connection limits of `connections.LimitedHttpProtocol`
and shutdown treat it like any other) whose body is collected by the parser's callbacks and
handed to the data plane when complete; the answer is written from the data plane's future
callback. No task runs unless an answer comes in parts.

It makes the decisions the ASGI layers in front of these routes make, the same way: the key
(`security.AccessKeys`), the body limit (a declared Content-Length over it is answered 413
before the body is read; a chunked body is counted as it arrives), `X-Request-Timeout`, and
errors answered by `errors.error_body` with their status and headers. A client that goes away
withdraws its request from the queue (the data plane counts it as 499); one that goes away
mid-body is counted as the request guard counts it. Everything the protocol does not take goes
to the ASGI app as before: other routes and methods, multipart bodies (Starlette reads forms),
and every request while the access log or tracing is on (they are ASGI layers;
`apps.http_apps` then makes no `ProtocolRoutes`).
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import TYPE_CHECKING, Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from scriptserve.server.rest.connections import LimitedHttpProtocol
from scriptserve.server.rest.hot_routes import ROUTES, hot_route
from scriptserve.server.rest.protocol_cycle import ProtocolCycle

if TYPE_CHECKING:
    from scriptserve.server.dataplane import DataPlane
    from scriptserve.server.metrics import ServerMetrics
    from scriptserve.server.security import AccessKeys

log = logging.getLogger("scriptserve.rest")

_METHODS = frozenset((b"POST", b"PUT"))


class ProtocolRoutes:
    """What the inference server's protocol needs to answer the four routes itself: the data
    plane, the key check and the body limit."""

    def __init__(
        self,
        dataplane: DataPlane,
        keys: AccessKeys,
        max_bytes: int,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.dataplane = dataplane
        self.keys = keys
        self.auth = keys.required("inference")
        self.max_bytes = max_bytes
        self._disconnects = metrics.client_disconnects.labels("inference") if metrics else None

    def cycle(self, protocol: InferenceHttpProtocol) -> ProtocolCycle | None:
        """The cycle of the request whose head the protocol has just read, when it is one of
        the four routes and nothing but the protocol needs to see it; else None."""
        parser = protocol.parser
        method = parser.get_method()
        if method not in _METHODS or parser.should_upgrade():
            return None
        raw_path = httptools.parse_url(protocol.url).path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        text = method.decode("ascii")
        route = hot_route(text, path)
        if route is None:
            return None
        cycle = ProtocolCycle(protocol, self, text, path, *route)
        if cycle.multipart:
            return None  # forms are read by Starlette's parser
        return cycle

    def disconnected(self, cycle: ProtocolCycle) -> None:
        if self._disconnects is not None:
            self._disconnects.inc()
        log.debug(
            "client went away before sending the whole request body: %s %s",
            cycle.method, ROUTES[cycle.route],
        )  # fmt: skip


class InferenceHttpProtocol(LimitedHttpProtocol):
    """The inference server's protocol: `LimitedHttpProtocol`, answering the four inference routes
    itself (see the module)."""

    routes: ClassVar[ProtocolRoutes]

    def _begin_request(self) -> None:
        cycle = self.routes.cycle(self)
        if cycle is None:
            super()._begin_request()
            return
        existing = self.cycle
        self.cycle = cycle
        if existing is None or existing.response_complete:
            cycle.begin()
        else:  # pipelined behind a request still being answered, as uvicorn queues them
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, None))  # type: ignore[arg-type]

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if isinstance(cycle, ProtocolCycle):
            cycle.begin()
        else:
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if isinstance(cycle, ProtocolCycle):
            cycle.body_part(body)
        else:
            super().on_body(body)
