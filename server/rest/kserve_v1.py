"""KServe's v1 protocol on the inference API: `GET /` (liveness), `GET /v1/models`,
`GET /v1/models/{m}` (readiness), `POST /v1/models/{m}:predict` and `:explain`.

Routes decode, call the data plane, and encode; errors answer `{"error": message}` as KServe's
own model server does (server/rest/errors.py). The inference API's key, body limit and
`X-Request-Timeout` apply as on every other inference route.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from scriptserve.server.codec import kserve_v1
from scriptserve.server.errors import ModelNotReady
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.rest.inference import DirectRoute, client_timeout

TAG = "KServe v1"
LIVENESS_PATH = "/"


def _post(app: FastAPI, path: str, endpoint: Callable[..., Any]) -> None:
    """A POST DirectRoute whose one path parameter, `model_name`, the endpoint reads itself."""
    parameter = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
    app.router.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        tags=[TAG],
        openapi_extra={"parameters": [parameter]},
        route_class_override=DirectRoute,
    )


def add_kserve_v1_routes(app: FastAPI, dataplane: DataPlane) -> None:
    """Add KServe v1's routes to the inference app."""

    @app.get(LIVENESS_PATH, tags=[TAG])
    async def live() -> dict[str, str]:
        return kserve_v1.live(dataplane.live())

    @app.get("/v1/models", tags=[TAG])
    async def models() -> dict[str, list[str]]:
        return {"models": dataplane.descriptions.model_names()}

    @app.get("/v1/models/{model_name}", tags=[TAG])
    async def model_ready(model_name: str) -> dict[str, Any]:
        if not dataplane.model_ready(model_name):
            raise ModelNotReady(f"model {model_name!r} is not ready; retry later")
        return {"name": model_name, "ready": True}

    async def run(request: Request, explain: bool) -> Response:
        body = await request.body()
        decode = partial(kserve_v1.instance_requests, body, request.headers, explain)
        served = await dataplane.infer_many(
            request.path_params["model_name"],
            None,
            decode,
            protocol="rest",
            timeout_s=client_timeout(request),
            item="instance",
            explain=explain,
        )
        payload = kserve_v1.encode([s.response for s in served], explain)
        return Response(payload, media_type="application/json")

    async def predict(request: Request) -> Response:
        return await run(request, explain=False)

    async def explain(request: Request) -> Response:
        return await run(request, explain=True)

    _post(app, "/v1/models/{model_name}:predict", predict)
    _post(app, "/v1/models/{model_name}:explain", explain)
