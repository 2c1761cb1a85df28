"""Start everything in one asyncio loop: three HTTP apps (uvicorn) and two gRPC servers
(grpc.aio) sharing one data plane.

The listeners start first, so liveness answers while models load; readiness follows the
models. SIGTERM / SIGINT starts the drain (see `drain`): readiness turns 503, every HTTP answer
carries `Connection: close` and the listeners close, in-flight requests finish (up to the drain
timeout), queued work drains, workers stop, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from scriptserve.server.errors import Conflict, ServingError
from scriptserve.server.grpc.server import GrpcServers
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models import snapshot
from scriptserve.server.models.management import Management
from scriptserve.server.models.object_store import sync_store
from scriptserve.server.models.registry import ModelRegistry, find_archives, find_pipelines
from scriptserve.server.models.repository import ModelRepository
from scriptserve.server.models.workflows import Workflows
from scriptserve.server.observability.access_log import AccessLog
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.observability.tracing import Tracing, TracingUnavailable
from scriptserve.server.rest.apps import HttpApp, http_apps
from scriptserve.server.rest.connection_limits import ConnectionLimits, HttpConnections
from scriptserve.server.security import resolve_keys
from scriptserve.server.settings import ServerSettings, parse_address

log = logging.getLogger("scriptserve.app")


class StartupError(RuntimeError):
    """The server cannot start; the message says what to change."""


class ModelStoreError(StartupError):
    """The model store is missing or not a directory: a setting must change (the CLI exits 2)."""


def check_model_store(settings: ServerSettings) -> None:
    """Refuse to start without a model store, rather than serve nothing without a word."""
    store = settings.model_store
    if not store.exists():
        raise ModelStoreError(
            f"model store {store} does not exist: create it, or name an existing directory "
            "with --model-store"
        )
    if not store.is_dir():
        raise ModelStoreError(f"model store {store} is not a directory (--model-store)")


async def prepare_model_store(settings: ServerSettings) -> None:
    """Copy a bucket model store's archives to its local directory, then check the store."""
    url = settings.model_store_url
    if url is not None:
        try:
            await sync_store(url, settings.model_store, settings)
        except ServingError as exc:
            raise ModelStoreError(f"model store {url}: {exc.message}") from None
    check_model_store(settings)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # One set of signal handlers for the whole process, installed by `serve`.
        yield

    def stop_accepting(self) -> None:
        """Close the listening sockets; open connections carry on."""
        for listener in getattr(self, "servers", ()):
            listener.close()


def _torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, without importing it (most of the
    start; a server of `.pt2` or ONNX models on CPU never needs it): its lib/ holds
    libtorch_cuda.so."""
    if "torch" in sys.modules:
        return True  # imported already: ask it
    spec = importlib.util.find_spec("torch")
    return (
        spec is None
        or spec.origin is None
        or (Path(spec.origin).parent / "lib" / "libtorch_cuda.so").exists()
    )


def available_devices(settings: ServerSettings) -> list[str]:
    if settings.device == "cpu" or (settings.device == "auto" and not _torch_has_cuda()):
        return ["cpu"]
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if settings.device == "cuda" and not gpus:
        raise StartupError("--device cuda was asked for but no CUDA device is visible")
    return [f"cuda:{i}" for i in range(gpus)] or ["cpu"]


def bind(address: str) -> socket.socket:
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {address}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def startup_sources(settings: ServerSettings) -> list[tuple[str | None, Path]]:
    """(name, archive) pairs from --models: `all`, `NAME=FILE` or `FILE` (in the model store)."""
    sources: list[tuple[str | None, Path]] = []
    for item in settings.models:
        if item == "all":
            sources.extend((None, p) for p in find_archives(settings.model_store))
            continue
        name, sep, file = item.partition("=")
        path = Path(file if sep else name)
        if not path.is_absolute():
            path = settings.model_store / path
        sources.append((name if sep else None, path))
    return sources


def restore_snapshot(settings: ServerSettings) -> bool:
    """Restore this replica's last snapshot unless told not to (--no-snapshot, or the declarative
    snapshot mode), or told which models to load (--models)."""
    return snapshot.enabled(settings) and settings.restore_snapshot and settings.models == ["all"]


async def load_startup_models(
    registry: ModelRegistry, settings: ServerSettings, stop: asyncio.Event
) -> None:
    """The last snapshot's models (see `restore_snapshot`), else the ones --models names."""
    restored = snapshot.read(settings) if restore_snapshot(settings) else None
    if restored is not None:
        for entry in restored:
            if stop.is_set():
                break
            mv = await registry.load(entry.source, entry.name, entry.settings, startup=True)
            if entry.default and mv.ready:
                registry.set_default(mv.name, mv.version)
    else:
        for name, path in startup_sources(settings):
            if stop.is_set():
                break
            try:
                await registry.load(path, name, startup=True)
            except Conflict as exc:  # two archives of the store hold the same model version
                log.error("archive %s is not loaded: %s", path.name, exc.message)
        for name, version in settings.default_versions.items():
            try:
                registry.set_default(name, version)
            except ServingError as exc:
                log.error("default version %s of model %s: %s", version, name, exc.message)
    if settings.models == ["all"]:
        for path in find_pipelines(settings.model_store):
            try:
                registry.pipelines.load(path, taken=set(registry.names()))
            except ServingError as exc:
                log.error("pipeline %s is not served: %s", path.name, exc.message)


def start_tracing(settings: ServerSettings) -> Tracing:
    """The tracer from the settings (and OTEL_* variables); StartupError when it cannot be."""
    try:
        return Tracing(
            settings.tracing,
            endpoint=settings.tracing_endpoint,
            protocol=settings.tracing_protocol,
            sampling_ratio=settings.tracing_sampling_ratio,
            service_name=settings.tracing_service_name,
        )
    except (TracingUnavailable, ValueError) as exc:
        raise StartupError(str(exc)) from None


def http_server(served: HttpApp, connections: HttpConnections) -> _Server:
    """The uvicorn server of one HTTP app, its connections counted in `connections`."""
    config = uvicorn.Config(
        served.app,
        http=connections.protocol_class(served.protocol_routes),
        ws="none",
        log_config=None,
        access_log=False,
        lifespan="off",
        proxy_headers=False,  # installed by `rest.apps.http_apps` where it is needed
        # `drain` has waited for the connections already: this is only for the last writes.
        timeout_graceful_shutdown=1,
        backlog=2048,
    )
    return _Server(config)


async def serve(settings: ServerSettings) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code."""
    await prepare_model_store(settings)  # before any port is bound
    # Workers run the model without the GIL but need it back to hand results over; with
    # Python's 5 ms default they queue behind a busy event loop (1 ms serves the overhead-bound
    # benchmark faster: benchmarks/README.md). The server owns its process, so it is set here.
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000.0)
    gc.set_threshold(settings.gc_young_threshold, 20, 20)
    keys = resolve_keys(settings)  # SecurityConfigError: the CLI exits 2 with its one line
    devices = available_devices(settings)
    metrics = ServerMetrics()
    try:
        registry = ModelRegistry(settings, metrics, devices)
    except ValueError as exc:  # a metrics_config that does not read
        raise StartupError(str(exc)) from None
    metrics.watch(
        registry.stats, registry.worker_gauges, registry.handler_metrics, registry.memory.stats
    )
    dataplane = DataPlane(registry, metrics, settings)
    management = Management(registry, dataplane.inflight_of, settings)
    repository = ModelRepository(management)
    workflows = Workflows(registry, management, settings)
    access = AccessLog(settings.access_log, settings.access_log_format)
    tracing = start_tracing(settings)
    apps = http_apps(
        settings, dataplane, management, repository, workflows, keys, metrics, access, tracing
    )
    sockets = [bind(served.address) for served in apps]
    connections = HttpConnections(ConnectionLimits.from_settings(settings))
    servers = [http_server(served, connections) for served in apps]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(s.serve(sockets=[sock]))
        for s, sock in zip(servers, sockets, strict=True)
    ]
    for served, sock in zip(apps, sockets, strict=True):
        host, port = sock.getsockname()[:2]
        log.info("%s API listening on http://%s:%d", served.name, host, port)
    grpc_servers = GrpcServers(dataplane, management, settings, keys, repository, tracing, access)
    try:
        grpc_servers.bind(settings.grpc_inference_address, settings.grpc_management_address)
    except RuntimeError as exc:
        raise StartupError(str(exc)) from None
    await grpc_servers.start()
    log.info(
        "gRPC inference on %s, gRPC management on %s",
        settings.grpc_inference_address,
        settings.grpc_management_address,
    )

    await load_startup_models(registry, settings, stop)
    management.on_change = snapshot.recorder(registry, settings)
    dataplane.starting = False
    await grpc_servers.serving()
    log.info(
        "startup complete: %d model version(s) ready",
        sum(mv.ready for mv in registry.all_versions()),
    )

    await stop.wait()
    await drain(settings, dataplane, connections, servers, grpc_servers)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, grpc_servers.stop(1.0), return_exceptions=True)
    await dataplane.close()
    workflows.close()
    for sock in sockets:
        sock.close()
    access.close()
    tracing.close()
    log.info("stopped")
    return 0


async def drain(
    settings: ServerSettings,
    dataplane: DataPlane,
    connections: HttpConnections,
    servers: list[_Server],
    grpc_servers: GrpcServers,
) -> None:
    """Answer what was accepted, tell every client to go elsewhere, and stop accepting.

    At once: readiness answers 503, gRPC health NOT_SERVING, every HTTP response that starts
    carries `Connection: close` (so no keep-alive client sends another request on a connection
    that is about to close), and the HTTP listeners close. Closing them first, before any client
    was told to reconnect, leaves the kernel's accept queue empty when it is reset; later, a
    reconnecting client would be refused, and a refused connection carries no request, so the
    client may retry it anywhere. Keep-alive connections get `drain_keepalive_grace_s` to send
    their next request, which is served (the workers are still there) and answered with
    `Connection: close`; those still idle then are closed, and from then on a new request (a
    gRPC call on an open channel) is answered 503 / UNAVAILABLE. The others close after their
    answer, all within `drain_timeout_s`.
    """
    log.info("shutting down: draining in-flight requests (up to %g s)", settings.drain_timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.drain_timeout_s
    # Both at once, in this order: a response that says `Connection: close` is a draining one
    # (readiness 503), never a 200 from a readiness check that raced with the signal.
    dataplane.draining = True
    connections.drain()
    for s in servers:
        s.stop_accepting()
    log.info("HTTP listeners closed; %d connection(s) open", len(connections.open))
    await grpc_servers.not_serving()
    grace = min(settings.drain_keepalive_grace_s, settings.drain_timeout_s)
    await connections.wait_closed(grace)
    connections.close_idle()
    requests_done = asyncio.ensure_future(dataplane.drain(max(0.0, deadline - loop.time())))
    if not await connections.wait_closed(max(0.0, deadline - loop.time())):
        log.warning("drain timeout: %d HTTP connection(s) still open", len(connections.open))
    if not await requests_done:
        log.warning("drain timeout: %d request(s) still in flight", dataplane.inflight)


def run(settings: ServerSettings) -> int:
    """Run `serve` on uvloop where available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(settings))
    return uvloop.run(serve(settings))
