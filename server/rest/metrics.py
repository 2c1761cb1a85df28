"""The metrics app: `GET /metrics` in Prometheus text format.

A scrape is rendered in a thread, not on the event loop: with hundreds of models it takes
hundreds of milliseconds (benchmarks/README.md), which on the loop would stall every request of
every model for as long."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.responses import Response

from scriptserve.server.observability.metrics import CONTENT_TYPE, ServerMetrics


def create_metrics_app(metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(title="scriptserve metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    return app
