"""The metrics app: `GET /metrics` in Prometheus text format."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import Response

from scriptserve.server.observability.metrics import CONTENT_TYPE, ServerMetrics


def create_metrics_app(metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(title="scriptserve metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
