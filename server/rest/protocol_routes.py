"""The inference routes, answered from the HTTP protocol's own callbacks: their one implementation.

`/predictions/{model}[/{version}]` (POST, PUT: TorchServe's `curl -T` sends a PUT) and
`/v2/models/{model}[/versions/{version}]/infer` (POST, JSON or binary tensors) carry nearly
every request a server answers. Through uvicorn, each request would be an ASGI cycle: a scope,
an `asyncio.Event`, a task running a coroutine through the ASGI layers, a `Request` and a
`Response` object, and two `send` messages whose headers uvicorn validates one by one: most
of the event loop's Python time for these routes. `InferenceHttpProtocol` serves them itself:
when a request head names one of them, it makes the route's cycle (`route_cycles.py`, each a
`protocol_cycle.ProtocolCycle`: a uvicorn `RequestResponseCycle`, so keep-alive, pipelining,
flow control, the connection limits of `connections.LimitedHttpProtocol` and shutdown treat it
like any other) whose body is collected by the parser's callbacks and handed to the data plane
when complete; the answer is written from the data plane's future callback. No task runs
unless an answer comes in parts or the body is a multipart form.

Whatever is switched on, these routes take this path: the key (`security.AccessKeys`), the
body limit (a declared Content-Length over it is answered 413 before the body is read; a
chunked body is counted as it arrives), `X-Request-Timeout`, the access log and tracing
(`observe.Observation`), and errors answered by `errors.error_body` with their status and
headers. A client that goes away withdraws its request from the queue (the data plane counts
it as 499); one that goes away mid-body is counted as the request guard counts it. Any other
method on these paths is answered 405. Every other route goes to the ASGI app (FastAPI), which
also describes these four in its OpenAPI document (`OPENAPI_PATHS`).
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import httptools
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from scriptserve.server.rest.connections import LimitedHttpProtocol
from scriptserve.server.rest.guard import Disconnects
from scriptserve.server.rest.protocol_cycle import ProtocolCycle
from scriptserve.server.rest.route_cycles import InferCycle, PredictionCycle

if TYPE_CHECKING:
    from scriptserve.server.inference.dataplane import DataPlane
    from scriptserve.server.observability.metrics import ServerMetrics
    from scriptserve.server.rest.observe import Observers
    from scriptserve.server.security import AccessKeys
    from scriptserve.server.settings import ServerSettings


class InferenceRoute(NamedTuple):
    """One of the inference routes the protocol answers."""

    template: str
    """The route's template, as the OpenAPI document, the access log and tracing name it."""
    methods: tuple[str, ...]
    predicts: bool
    """TorchServe's predictions (else Open Inference Protocol's infer)."""


PREDICT = InferenceRoute("/predictions/{model_name}", ("POST", "PUT"), True)
PREDICT_VERSION = InferenceRoute("/predictions/{model_name}/{version}", ("POST", "PUT"), True)
INFER = InferenceRoute("/v2/models/{model_name}/infer", ("POST",), False)
INFER_VERSION = InferenceRoute("/v2/models/{model_name}/versions/{version}/infer", ("POST",), False)
ROUTES = (PREDICT, PREDICT_VERSION, INFER, INFER_VERSION)
_PREDICTIONS = "/predictions/"
_MODELS = "/v2/models/"
_INFER_SUFFIX = "/infer"


def inference_route(path: str) -> tuple[InferenceRoute, str, str | None] | None:
    """Which inference route a path is, with its model name and version (None: the default
    version); None when it is none of them."""
    if path.startswith(_PREDICTIONS):
        parts = path[len(_PREDICTIONS) :].split("/")
        if len(parts) == 1 and parts[0]:
            return PREDICT, parts[0], None
        if len(parts) == 2 and parts[0] and parts[1]:
            return PREDICT_VERSION, parts[0], parts[1]
        return None
    if path.startswith(_MODELS) and path.endswith(_INFER_SUFFIX):
        parts = path[len(_MODELS) : -len(_INFER_SUFFIX)].split("/")
        if len(parts) == 1 and parts[0]:
            return INFER, parts[0], None
        if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
            return INFER_VERSION, parts[0], parts[2]
    return None


class ProtocolRoutes:
    """What the inference server's protocol needs to answer the inference routes: the data
    plane, the key check, the body and form limits, the access log and tracing."""

    def __init__(
        self,
        dataplane: DataPlane,
        keys: AccessKeys,
        settings: ServerSettings,
        observers: Observers,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.dataplane = dataplane
        self.keys = keys
        self.auth = keys.required("inference")
        self.max_bytes = settings.max_request_bytes
        self.settings = settings
        self.observers = observers
        self.disconnected = Disconnects(metrics, "inference")

    def cycle(self, protocol: InferenceHttpProtocol) -> ProtocolCycle | None:
        """The cycle of the request whose head the protocol has just read, when its path is
        one of the inference routes; else None (the ASGI app answers it)."""
        parser = protocol.parser
        if parser.should_upgrade():
            return None  # uvicorn stops parsing at an upgrade: the app answers what it can
        path = httptools.parse_url(protocol.url).path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        found = inference_route(path)
        if found is None:
            return None
        cycle = PredictionCycle if found[0].predicts else InferCycle
        return cycle(protocol, self, parser.get_method().decode("ascii"), path, *found)


class InferenceHttpProtocol(LimitedHttpProtocol):
    """The inference server's protocol: `LimitedHttpProtocol`, answering the inference routes
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


def _operation(
    tag: str, operation_id: str, summary: str, params: tuple[str, ...], media: tuple[str, ...]
) -> dict[str, Any]:
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in params
    ]
    body = {"content": {m: {"schema": {}} for m in media}, "required": True}
    errors = {"description": "An error, as JSON: what to fix"}
    return {
        "tags": [tag],
        "summary": summary,
        "operationId": operation_id,
        "parameters": parameters,
        "requestBody": body,
        "responses": {"200": {"description": "The model's answer"}, "4XX": errors, "5XX": errors},
    }


def _openapi_paths() -> dict[str, dict[str, Any]]:
    paths: dict[str, dict[str, Any]] = {}
    media: tuple[str, ...]
    for route in ROUTES:
        versioned = "{version}" in route.template
        params = ("model_name", "version") if versioned else ("model_name",)
        if route.predicts:
            summary = "TorchServe's prediction API: the body (or each form field) is the input"
            tag, name = "TorchServe", "predictions_version" if versioned else "predictions"
            media = ("application/json", "application/octet-stream", "multipart/form-data")
        else:
            summary = (
                "Open Inference Protocol v2 inference: JSON tensors, or binary tensors after "
                "the JSON header (Inference-Header-Content-Length)"
            )
            tag, name = "OIP v2", "infer_version" if versioned else "infer_default"
            media = ("application/json", "application/octet-stream")
        paths[route.template] = {
            method.lower(): _operation(tag, f"{name}_{method.lower()}", summary, params, media)
            for method in route.methods
        }
    return paths


OPENAPI_PATHS = _openapi_paths()
"""The inference routes as the inference app's OpenAPI document describes them."""
