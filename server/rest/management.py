"""The management API: TorchServe's routes and parameters (register, scale, describe, list,
unregister, set-default). Each route hands its parameters to `server/management.py`."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query
from starlette.responses import JSONResponse, Response

from scriptserve import __version__
from scriptserve.server.management import Management, Registration, Scaling
from scriptserve.server.rest.errors import install_error_handlers
from scriptserve.server.settings import ServerSettings


def _status(done: bool, message: str) -> Response:
    return JSONResponse({"status": message}, 200 if done else 202)


def create_management_app(management: Management, settings: ServerSettings) -> FastAPI:
    app = FastAPI(
        title="scriptserve management API",
        version=__version__,
        docs_url="/docs" if settings.docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.docs else None,
    )
    install_error_handlers(app)

    @app.get("/")
    async def server_version() -> dict[str, str]:
        return {"name": "scriptserve", "version": __version__}

    @app.post("/models")
    async def register(registration: Annotated[Registration, Query()]) -> Response:
        return _status(*await management.register(registration))

    @app.get("/models")
    async def list_models(
        limit: int = Query(100, ge=1, le=1000), next_page_token: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        return management.list_models(limit, next_page_token)

    @app.get("/models/{model_name}")
    async def describe(model_name: str) -> list[dict[str, Any]]:
        return management.describe(model_name)

    @app.get("/models/{model_name}/{version}")
    async def describe_version(model_name: str, version: str) -> list[dict[str, Any]]:
        return management.describe(model_name, version)

    @app.put("/models/{model_name}")
    async def scale_default(model_name: str, scaling: Annotated[Scaling, Query()]) -> Response:
        return _status(*await management.scale(model_name, None, scaling))

    @app.put("/models/{model_name}/{version}")
    async def scale_version(
        model_name: str, version: str, scaling: Annotated[Scaling, Query()]
    ) -> Response:
        return _status(*await management.scale(model_name, version, scaling))

    @app.put("/models/{model_name}/{version}/set-default")
    async def set_default(model_name: str, version: str) -> dict[str, str]:
        return {"status": management.set_default(model_name, version)}

    @app.delete("/models/{model_name}")
    async def unregister_default(model_name: str) -> dict[str, str]:
        return {"status": await management.unregister(model_name, None)}

    @app.delete("/models/{model_name}/{version}")
    async def unregister(model_name: str, version: str) -> dict[str, str]:
        return {"status": await management.unregister(model_name, version)}

    return app
