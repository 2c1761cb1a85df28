"""The management API: TorchServe's routes and parameters (register, scale, describe, list,
unregister, set-default)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query
from starlette.responses import JSONResponse, Response

from scriptserve.server.dataplane import DataPlane
from scriptserve.server.rest.errors import install_error_handlers
from scriptserve.server.settings import ServerSettings


def _status(done: bool, message: str) -> Response:
    return JSONResponse({"status": message}, 200 if done else 202)


def create_management_app(dataplane: DataPlane, settings: ServerSettings) -> FastAPI:
    app = FastAPI(
        title="scriptserve management API",
        version="0.1.0",
        docs_url="/docs" if settings.docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.docs else None,
    )
    install_error_handlers(app)

    @app.post("/models")
    async def register(
        url: str = Query(description="archive file name in the model store"),
        model_name: str | None = None,
        batch_size: int | None = Query(None, ge=1),
        max_batch_delay: float | None = Query(None, ge=0, description="milliseconds"),
        initial_workers: int | None = Query(None, ge=1),
        response_timeout: float | None = Query(None, gt=0, description="seconds"),
        queue_size: int | None = Query(None, ge=1),
        quantize: str | None = Query(None, description="dynamic-int8: convert at load"),
        worker_mode: str | None = Query(
            None, pattern="^(thread|process)$", description="thread or process workers"
        ),
        synchronous: bool = True,
    ) -> Response:
        overrides: dict[str, Any] = {
            "batch_size": batch_size,
            "max_batch_delay_ms": max_batch_delay,
            "workers": initial_workers,
            "response_timeout_s": response_timeout,
            "queue_size": queue_size,
            "quantize": quantize,
            "worker_mode": worker_mode,
        }
        done, message = await dataplane.register(url, model_name, overrides, synchronous)
        return _status(done, message)

    @app.get("/models")
    async def list_models(
        limit: int = Query(100, ge=1, le=1000), next_page_token: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        return dataplane.list_models(limit, next_page_token)

    @app.get("/models/{model_name}")
    async def describe(model_name: str) -> list[dict[str, Any]]:
        return dataplane.describe(model_name)

    @app.get("/models/{model_name}/{version}")
    async def describe_version(model_name: str, version: str) -> list[dict[str, Any]]:
        return dataplane.describe(model_name, version)

    async def scale(
        model_name: str, version: str | None, min_worker: int, max_worker: int | None,
        synchronous: bool,
    ) -> Response:  # fmt: skip
        # Thread workers need no elastic range: the pool runs max(min, max) workers.
        workers = max(min_worker, max_worker if max_worker is not None else min_worker)
        done, message = await dataplane.scale(model_name, version, workers, synchronous)
        return _status(done, message)

    @app.put("/models/{model_name}")
    async def scale_default(
        model_name: str,
        min_worker: int = Query(1, ge=0),
        max_worker: int | None = Query(None, ge=0),
        synchronous: bool = False,
    ) -> Response:
        return await scale(model_name, None, min_worker, max_worker, synchronous)

    @app.put("/models/{model_name}/{version}")
    async def scale_version(
        model_name: str,
        version: str,
        min_worker: int = Query(1, ge=0),
        max_worker: int | None = Query(None, ge=0),
        synchronous: bool = False,
    ) -> Response:
        return await scale(model_name, version, min_worker, max_worker, synchronous)

    @app.put("/models/{model_name}/{version}/set-default")
    async def set_default(model_name: str, version: str) -> dict[str, str]:
        return {"status": dataplane.set_default(model_name, version)}

    @app.delete("/models/{model_name}")
    async def unregister_default(model_name: str) -> dict[str, str]:
        return {"status": await dataplane.unregister(model_name, None)}

    @app.delete("/models/{model_name}/{version}")
    async def unregister(model_name: str, version: str) -> dict[str, str]:
        return {"status": await dataplane.unregister(model_name, version)}

    return app
