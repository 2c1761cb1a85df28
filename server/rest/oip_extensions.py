"""Triton's protocol extensions on the inference API: model configuration, statistics and the
model repository (docs/protocol/extension_*.md in triton-inference-server/server).

    GET  /v2/models[/{m}[/versions/{v}]]/stats          statistics
    GET  /v2/models/{m}[/versions/{v}]/config            model configuration
    POST /v2/repository/index                            {"ready": bool}
    POST /v2/repository/models/{m}/load | /unload        {"parameters": {...}}

The repository routes take the management key (the request guard's `management_paths`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from scriptserve.server.errors import InvalidInput
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models.repository import ModelRepository

TAG = "OIP v2 extensions"
REPOSITORY_PREFIX = "/v2/repository/"


def add_model_extension_routes(app: FastAPI, dataplane: DataPlane) -> None:
    """The configuration and statistics routes. Add them before the model metadata routes:
    `/v2/models/stats` is the statistics of every model, as in Triton, not a model's metadata."""

    @app.get("/v2/models/stats", tags=[TAG])
    async def all_statistics() -> dict[str, Any]:
        return {"model_stats": dataplane.descriptions.statistics()}

    @app.get("/v2/models/{model_name}/stats", tags=[TAG])
    async def model_statistics(model_name: str) -> dict[str, Any]:
        return {"model_stats": dataplane.descriptions.statistics(model_name)}

    @app.get("/v2/models/{model_name}/versions/{version}/stats", tags=[TAG])
    async def version_statistics(model_name: str, version: str) -> dict[str, Any]:
        return {"model_stats": dataplane.descriptions.statistics(model_name, version)}

    @app.get("/v2/models/{model_name}/config", tags=[TAG])
    async def model_config(model_name: str) -> dict[str, Any]:
        return dataplane.descriptions.model_config(model_name)

    @app.get("/v2/models/{model_name}/versions/{version}/config", tags=[TAG])
    async def version_config(model_name: str, version: str) -> dict[str, Any]:
        return dataplane.descriptions.model_config(model_name, version)


async def _json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object; an empty body is an empty object."""
    body = await request.body()
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidInput("the request body must be a JSON object (or empty)")
    return value


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return parameters


def _body_schema(properties: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI description of an optional JSON object body a route reads itself."""
    schema = {"type": "object", "properties": properties}
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": schema}}}}


def add_repository_routes(app: FastAPI, repository: ModelRepository) -> None:
    """Index, load and unload (they need the management key and, to change what is loaded,
    `--enable-model-api`)."""

    @app.post(
        "/v2/repository/index",
        tags=[TAG],
        openapi_extra=_body_schema({"ready": {"type": "boolean"}}),
    )
    async def index(request: Request) -> Response:
        ready = (await _json_object(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("'ready' must be true or false")
        return JSONResponse(repository.index(ready))

    parameters_schema = _body_schema({"parameters": {"type": "object"}})

    @app.post(
        "/v2/repository/models/{model_name}/load", tags=[TAG], openapi_extra=parameters_schema
    )
    async def load(model_name: str, request: Request) -> Response:
        await repository.load(model_name, _parameters(await _json_object(request)))
        return Response(status_code=200)

    @app.post(
        "/v2/repository/models/{model_name}/unload", tags=[TAG], openapi_extra=parameters_schema
    )
    async def unload(model_name: str, request: Request) -> Response:
        await repository.unload(model_name, _parameters(await _json_object(request)))
        return Response(status_code=200)
