"""The management API: TorchServe's routes and parameters (register, scale, describe, list,
unregister, set-default), and profiling on demand. Each route hands its parameters to
`server/models/management.py`."""

from __future__ import annotations

import gzip
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from starlette.responses import JSONResponse, Response

from scriptserve import __version__
from scriptserve.server.models.management import Management, Registration, Scaling
from scriptserve.server.models.profiling import ProfileOptions, ProfileResult
from scriptserve.server.rest.errors import install_error_handlers
from scriptserve.server.settings import ServerSettings


def _status(done: bool, message: str) -> Response:
    return JSONResponse({"status": message}, 200 if done else 202)


def _trace(result: ProfileResult, request: Request) -> Response:
    """The trace file, compressed when the client takes gzip (`curl --compressed`)."""
    headers = {
        "Content-Disposition": f'attachment; filename="{result.file_name}"',
        "X-Profile-Batches": str(result.batches),
        "X-Profile-Seconds": f"{result.seconds:.3f}",
        "Vary": "Accept-Encoding",
    }
    if "gzip" in request.headers.get("accept-encoding", ""):
        headers["Content-Encoding"] = "gzip"
        return Response(result.trace, media_type="application/json", headers=headers)
    return Response(gzip.decompress(result.trace), media_type="application/json", headers=headers)


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

    @app.post("/models/{model_name}/profile")
    async def profile_default(
        model_name: str, options: Annotated[ProfileOptions, Query()], request: Request
    ) -> Response:
        return _trace(await management.profile(model_name, None, options), request)

    @app.post("/models/{model_name}/{version}/profile")
    async def profile(
        model_name: str,
        version: str,
        options: Annotated[ProfileOptions, Query()],
        request: Request,
    ) -> Response:
        return _trace(await management.profile(model_name, version, options), request)

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
