"""The server's three HTTP apps (inference, management, metrics), each with the layers in front
of it: the request guard, uvicorn's proxy-headers layer, and the access log and tracing when
either is on; and the inference routes the inference server's HTTP protocol answers itself
(`protocol_routes.py`), whatever is on."""

from __future__ import annotations

from typing import Any, NamedTuple

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models.management import Management
from scriptserve.server.models.repository import ModelRepository
from scriptserve.server.models.workflows import Workflows
from scriptserve.server.observability.access_log import AccessLog
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.observability.tracing import Tracing
from scriptserve.server.rest.guard import guarded
from scriptserve.server.rest.inference import create_inference_app
from scriptserve.server.rest.kserve_v1 import LIVENESS_PATH, add_kserve_v1_routes
from scriptserve.server.rest.management import create_management_app
from scriptserve.server.rest.metrics import create_metrics_app
from scriptserve.server.rest.observe import Observed, Observers
from scriptserve.server.rest.oip_extensions import REPOSITORY_PREFIX, add_repository_routes
from scriptserve.server.rest.openai_embeddings import add_openai_routes
from scriptserve.server.rest.protocol_routes import ProtocolRoutes
from scriptserve.server.rest.shared_address import SharedAddress
from scriptserve.server.rest.workflows import (
    add_workflow_management_routes,
    add_workflow_prediction_route,
)
from scriptserve.server.security import AccessKeys
from scriptserve.server.settings import ServerSettings


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
    workflows: Workflows,
    keys: AccessKeys,
    metrics: ServerMetrics,
    access: AccessLog,
    tracing: Tracing,
) -> list[HttpApp]:
    """The inference, management and metrics apps, each behind its guard (and the access log
    and tracing when either is on), with the address it listens on; the inference server's
    protocol answers the inference routes itself."""
    limit = settings.max_request_bytes
    # Probes carry no key: liveness and readiness stay open and say nothing else.
    probes = ("/ping", "/v2/health/live", "/v2/health/ready", LIVENESS_PATH)
    inference = create_inference_app(dataplane, settings)
    add_kserve_v1_routes(inference, dataplane)
    add_openai_routes(inference, dataplane)
    add_repository_routes(inference, repository)
    add_workflow_prediction_route(inference, dataplane, workflows, settings)
    management_app = create_management_app(management, settings)
    add_workflow_management_routes(management_app, workflows)
    observers = Observers(access, tracing)
    apps: list[tuple[str, Any, str]] = [
        (
            "inference",
            guarded(
                inference,
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
                management_app,
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
    if observers.enabled:  # outside the guard: refused requests are logged and traced too
        apps = [
            (what, Observed(app, observers) if what != "metrics" else app, address)
            for what, app, address in apps
        ]
    # uvicorn's proxy-headers layer: the client's address and scheme from X-Forwarded-* when
    # the peer is a loopback proxy, for everything behind it (the protocol applies the same
    # rule to the inference routes it answers).
    apps = [
        (what, forwarded(app) if what != "metrics" else app, address) for what, app, address in apps
    ]
    protocol_routes = ProtocolRoutes(dataplane, keys, settings, observers, metrics)
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
