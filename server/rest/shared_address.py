"""Inference and management on one address, as TorchServe allows: KServe's TorchServe samples
give both `http://0.0.0.0:8085`. TorchServe's management routes (`/models` and below) go to the
management app, behind the management key as on their own address; everything else goes to the
inference app (where `GET /` is KServe v1's liveness)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

MANAGEMENT_ROUTES = "/models"


class SharedAddress:
    """One ASGI app of the inference and the management apps, each already guarded."""

    def __init__(self, inference: ASGIApp, management: ASGIApp) -> None:
        self.inference = inference
        self.management = management

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if path == MANAGEMENT_ROUTES or path.startswith(MANAGEMENT_ROUTES + "/"):
            await self.management(scope, receive, send)
        else:
            await self.inference(scope, receive, send)
