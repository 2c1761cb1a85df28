"""The server's three HTTP apps (inference, management, metrics), each with the layers in front
of it: the request guard, the inference routes served below FastAPI, and the access log,
tracing and uvicorn's proxy-headers layer where they are needed."""

from __future__ import annotations

from typing import Any, NamedTuple

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from scriptserve.server.access_log import AccessLog
from scriptserve.server.dataplane import DataPlane
from scriptserve.server.management import Management
from scriptserve.server.metrics import ServerMetrics
from scriptserve.server.repository import ModelRepository
from scriptserve.server.rest.access import AccessLogged
from scriptserve.server.rest.guard import guarded
from scriptserve.server.rest.hot_routes import HotRoutes
from scriptserve.server.rest.inference import create_inference_app
from scriptserve.server.rest.kserve_v1 import LIVENESS_PATH, add_kserve_v1_routes
from scriptserve.server.rest.management import create_management_app
from scriptserve.server.rest.metrics import create_metrics_app
from scriptserve.server.rest.oip_extensions import REPOSITORY_PREFIX, add_repository_routes
from scriptserve.server.rest.openai_embeddings import add_openai_routes
from scriptserve.server.rest.protocol_routes import ProtocolRoutes
from scriptserve.server.rest.shared_address import SharedAddress
from scriptserve.server.rest.tracing import Traced
from scriptserve.server.security import AccessKeys
from scriptserve.server.settings import ServerSettings
from scriptserve.server.tracing import Tracing


def forwarded(app: Any) -> Any:
    """`app` behind uvicorn's proxy-headers layer: the client's address and scheme from
    X-Forwarded-For / X-Forwarded-Proto when the peer is a proxy on loopback (uvicorn's
    default trust)."""
    return ProxyHeadersMiddleware(app)


class HttpApp(NamedTuple):
    """One HTTP server: what it serves, its ASGI app, its address, and the inference routes
    its protocol answers itself (None: every request goes to the app)."""

    name: str
    app: Any
    address: str
    protocol_routes: ProtocolRoutes | None = None


def http_apps(
    settings: ServerSettings,
    dataplane: DataPlane,
    management: Management,
    repository: ModelRepository,
    keys: AccessKeys,
    metrics: ServerMetrics,
    access: AccessLog,
    tracing: Tracing,
) -> list[HttpApp]:
    """The inference, management and metrics apps, each behind its guard (and the access log
    and tracing when they are on), with the address it listens on; the inference server's
    protocol answers the inference routes itself while neither the access log nor tracing
    is on."""
    limit = settings.max_request_bytes
    # Probes carry no key: liveness and readiness stay open and say nothing else.
    probes = ("/ping", "/v2/health/live", "/v2/health/ready", LIVENESS_PATH)
    inference = create_inference_app(dataplane, settings)
    add_kserve_v1_routes(inference.app, dataplane)
    add_openai_routes(inference.app, dataplane)
    add_repository_routes(inference.app, repository)
    # uvicorn's proxy-headers layer (the client's address and scheme from X-Forwarded-* when the
    # peer is a loopback proxy) runs where something reads them: outside the access log and
    # tracing when they are on, and in front of the FastAPI apps; the hot inference routes
    # read neither.
    hot_routes = HotRoutes(
        forwarded(inference.app), inference.app.routes, inference.predict,
        inference.infer,
    )  # fmt: skip
    apps: list[tuple[str, Any, str]] = [
        (
            "inference",
            guarded(
                hot_routes,
                keys,
                "inference",
                limit,
                *probes,
                metrics=metrics,
                # Triton's repository extension loads and unloads models: the management key.
                management_paths=(REPOSITORY_PREFIX,),
            ),
            settings.inference_address,
        ),
        (
            "management",
            guarded(
                forwarded(create_management_app(management, settings)),
                keys,
                "management",
                limit,
                metrics=metrics,
            ),
            settings.management_address,
        ),
        # Prometheus scrapes without a key; the metrics port binds loopback by default.
        (
            "metrics",
            guarded(create_metrics_app(metrics), keys, "inference", limit, "/metrics"),
            settings.metrics_address,
        ),
    ]
    if tracing.enabled:  # outside the guard: refused requests are traced too
        apps = [
            (what, Traced(app, tracing) if what != "metrics" else app, address)
            for what, app, address in apps
        ]
    if access.enabled:  # an ASGI layer costs every request: only when there is a log to write
        apps = [
            (what, AccessLogged(app, access) if what != "metrics" else app, address)
            for what, app, address in apps
        ]
    if access.enabled or tracing.enabled:
        apps = [(what, forwarded(app), address) for what, app, address in apps]
    protocol_routes = None
    if not (access.enabled or tracing.enabled):
        protocol_routes = ProtocolRoutes(dataplane, keys, limit, metrics)
    if settings.inference_address == settings.management_address:  # TorchServe allows it
        (_, inference_app, address), (_, management_app, _), (_, metrics_app, metrics_address) = (
            apps
        )
        shared = SharedAddress(inference_app, management_app)
        return [
            HttpApp("inference and management", shared, address, protocol_routes),
            HttpApp("metrics", metrics_app, metrics_address),
        ]
    (_, inference_app, address), management_server, metrics_server = apps
    return [
        HttpApp("inference", inference_app, address, protocol_routes),
        HttpApp(*management_server),
        HttpApp(*metrics_server),
    ]
