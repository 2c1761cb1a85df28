"""The inference API's FastAPI app: TorchServe's `/ping`, Open Inference Protocol v2's health and
metadata, and Triton's generate extension (`server/rest/streams.py` writes the answers that
come in parts). TorchServe's `/predictions` and OIP's `infer` are answered by the HTTP protocol
(`protocol_routes.py`); this app's OpenAPI document describes them too.

Routes decode the wire format, call the data plane, and encode its answer; nothing else.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response
from starlette.routing import request_response as starlette_request_response

from scriptserve import __version__
from scriptserve.server.codec import generate, torchserve
from scriptserve.server.codec.header_values import TIMEOUT_HEADER, request_timeout
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.rest.errors import install_error_handlers
from scriptserve.server.rest.oip_extensions import add_model_extension_routes
from scriptserve.server.rest.protocol_routes import OPENAPI_PATHS
from scriptserve.server.rest.streams import generate_answer, generate_stream_answer
from scriptserve.server.settings import ServerSettings


def client_timeout(request: Request) -> float | None:
    """Seconds from `X-Request-Timeout`: it may shorten the server's deadline, never lengthen it."""
    return request_timeout(request.headers.get(TIMEOUT_HEADER))


class DirectRoute(APIRoute):
    """A route whose endpoint takes the Request and returns a Response itself.

    It is documented like any FastAPI route, but served by Starlette's plain request/response
    wrapper: no dependency solving and no per-call exit stacks, a large share of the event
    loop's time per request on the inference path (benchmarks/README.md). Errors still reach
    the app's handlers.
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.app = starlette_request_response(endpoint)


def _direct_post(
    app: FastAPI, path: str, tag: str, *params: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a POST endpoint as a DirectRoute whose path parameters are strings."""

    def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            tags=[tag],
            openapi_extra=_path_params(*params),
            route_class_override=DirectRoute,
        )
        return endpoint

    return register


def _path_params(*names: str) -> dict[str, Any]:
    """OpenAPI description of string path parameters a route reads itself."""
    return {
        "parameters": [
            {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
        ]
    }


def _with_protocol_routes(app: FastAPI) -> None:
    """The app's OpenAPI document, with the inference routes the HTTP protocol answers."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, routes=app.routes, tags=app.openapi_tags
            )
            document["paths"] = {**OPENAPI_PATHS, **document.get("paths", {})}
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_inference_app(dataplane: DataPlane, settings: ServerSettings) -> FastAPI:
    app = FastAPI(
        title="scriptserve inference API",
        version=__version__,
        docs_url="/docs" if settings.docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.docs else None,
    )
    install_error_handlers(app)

    # -- TorchServe ------------------------------------------------------------------------
    @app.get("/ping", tags=["TorchServe"])
    async def ping() -> Response:
        ready = dataplane.ready()
        return JSONResponse(torchserve.health(ready), 200 if ready else 503)

    # -- Open Inference Protocol v2 ----------------------------------------------------------
    @app.get("/v2", tags=["OIP v2"])
    async def server_metadata() -> dict[str, Any]:
        return dataplane.descriptions.server_metadata()

    @app.get("/v2/health/live", tags=["OIP v2"])
    async def live() -> dict[str, bool]:
        return {"live": dataplane.live()}

    @app.get("/v2/health/ready", tags=["OIP v2"])
    async def ready() -> Response:
        is_ready = dataplane.ready()
        return JSONResponse({"ready": is_ready}, 200 if is_ready else 503)

    # Before the metadata routes: /v2/models/stats is every model's statistics.
    add_model_extension_routes(app, dataplane)

    def metadata(model_name: str, version: str | None) -> dict[str, Any]:
        meta = dataplane.descriptions.model_metadata(model_name, version)
        body: dict[str, Any] = {
            "name": meta.name,
            "versions": meta.versions,
            "platform": meta.platform,
            "inputs": [t.to_dict() for t in meta.inputs],
            "outputs": [t.to_dict() for t in meta.outputs],
        }
        if meta.parameters.get("quantization", "none") != "none" or "residence" in meta.parameters:
            body["parameters"] = meta.parameters  # else the spec's exact shape
        return body

    @app.get("/v2/models/{model_name}", tags=["OIP v2"])
    async def model_metadata(model_name: str) -> dict[str, Any]:
        return metadata(model_name, None)

    @app.get("/v2/models/{model_name}/versions/{version}", tags=["OIP v2"])
    async def model_version_metadata(model_name: str, version: str) -> dict[str, Any]:
        return metadata(model_name, version)

    def model_ready(model_name: str, version: str | None) -> Response:
        is_ready = dataplane.model_ready(model_name, version)
        return JSONResponse({"name": model_name, "ready": is_ready}, 200 if is_ready else 503)

    @app.get("/v2/models/{model_name}/ready", tags=["OIP v2"])
    async def model_ready_default(model_name: str) -> Response:
        return model_ready(model_name, None)

    @app.get("/v2/models/{model_name}/versions/{version}/ready", tags=["OIP v2"])
    async def model_version_ready(model_name: str, version: str) -> Response:
        return model_ready(model_name, version)

    # -- Triton's generate extension ----------------------------------------------------------
    async def generate_one(request: Request, model_name: str, version: str | None) -> Response:
        body, headers = await request.body(), request.headers
        served = await dataplane.submit(
            model_name,
            version,
            lambda: generate.generate_request(body, headers),
            protocol="rest",
            timeout_s=client_timeout(request),
        )
        return generate_answer(served)

    async def generate_stream(request: Request, model_name: str, version: str | None) -> Response:
        body, headers = await request.body(), request.headers
        stream = dataplane.stream(
            model_name,
            version,
            lambda: generate.generate_request(body, headers),
            protocol="rest",
            timeout_s=client_timeout(request),
        )
        return await generate_stream_answer(stream, request)

    for suffix, run in (("generate", generate_one), ("generate_stream", generate_stream)):
        _add_versioned_post(app, f"/v2/models/{{model_name}}/{suffix}", run, "OIP generate")

    _with_protocol_routes(app)
    return app


def _add_versioned_post(
    app: FastAPI,
    path: str,
    run: Callable[[Request, str, str | None], Awaitable[Response]],
    tag: str,
) -> None:
    """POST `path` and its `/versions/{version}` form, both calling `run(request, name,
    version)`."""
    head, tail = path.rsplit("/", 1)

    async def default(request: Request) -> Response:
        return await run(request, request.path_params["model_name"], None)

    async def versioned(request: Request) -> Response:
        params = request.path_params
        return await run(request, params["model_name"], params["version"])

    default.__name__ = f"{tail}_default"
    versioned.__name__ = f"{tail}_version"
    _direct_post(app, path, tag, "model_name")(default)
    with_version = f"{head}/versions/{{version}}/{tail}"
    _direct_post(app, with_version, tag, "model_name", "version")(versioned)
