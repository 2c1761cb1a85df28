"""The gRPC servers: inference (OIP v2 + TorchServe) and management, on the HTTP apps' loop.

Both serve the standard health service (`grpc.health.v1`) and server reflection. The inference
port says SERVING once the startup models are loaded (as /v2/health/ready does); on drain both
turn NOT_SERVING and in-flight calls get the drain timeout to finish. Connections are bounded by
the settings' stream, keepalive and idle/age limits (`server_options`); a request that is not a
valid protobuf message is INVALID_ARGUMENT (`server/grpc/malformed.py`).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from scriptserve.server.grpc._generated import (
    inference_pb2,
    management_pb2,
    open_inference_grpc_pb2,
)
from scriptserve.server.grpc._generated import inference_pb2_grpc as ts_grpc
from scriptserve.server.grpc._generated import management_pb2_grpc as mgmt_grpc
from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as oip_grpc
from scriptserve.server.grpc.access import AccessInterceptor
from scriptserve.server.grpc.auth import interceptors
from scriptserve.server.grpc.inference import InferenceServicer, TorchServeInferenceServicer
from scriptserve.server.grpc.malformed import register
from scriptserve.server.grpc.management import ManagementServicer
from scriptserve.server.grpc.tracing import TracingInterceptor
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models.management import Management
from scriptserve.server.models.repository import ModelRepository
from scriptserve.server.observability.access_log import AccessLog
from scriptserve.server.observability.tracing import Tracing
from scriptserve.server.security import AccessKeys
from scriptserve.server.settings import ServerSettings

_OIP = open_inference_grpc_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
REPOSITORY_METHODS = frozenset(
    f"/{_OIP}/{method}"
    for method in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
)
"""Triton's repository extension on the inference port: they take the management key."""
_TS = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name
_MGMT = management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"].full_name


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    """The grpc core channel arguments of both servers (docs/security.md, "Connections")."""
    options = [
        ("grpc.max_receive_message_length", settings.grpc_max_message_bytes),
        ("grpc.max_send_message_length", settings.grpc_max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        ("grpc.keepalive_time_ms", _ms(settings.grpc_keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.grpc_keepalive_timeout_s)),
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            round(settings.grpc_keepalive_min_ping_interval_s * 1000),
        ),
        ("grpc.http2.max_ping_strikes", settings.grpc_keepalive_max_ping_strikes),
        ("grpc.http2.max_pings_without_data", settings.grpc_keepalive_max_pings_without_data),
        ("grpc.keepalive_permit_without_calls", int(settings.grpc_keepalive_permit_without_calls)),
    ]
    if settings.grpc_max_connection_idle_s:
        options.append(("grpc.max_connection_idle_ms", _ms(settings.grpc_max_connection_idle_s)))
    if settings.grpc_max_connection_age_s:
        options += [
            ("grpc.max_connection_age_ms", _ms(settings.grpc_max_connection_age_s)),
            (
                "grpc.max_connection_age_grace_ms",
                round(settings.grpc_max_connection_age_grace_s * 1000),
            ),
        ]
    return options


class GrpcServers:
    """The two gRPC servers and their health services."""

    def __init__(
        self,
        dataplane: DataPlane,
        management: Management,
        settings: ServerSettings,
        keys: AccessKeys | None = None,
        repository: ModelRepository | None = None,
        tracing: Tracing | None = None,
        access: AccessLog | None = None,
    ) -> None:
        keys = keys or AccessKeys(None, None, enforced=False)
        repository = repository or ModelRepository(management)
        options = server_options(settings)
        # The access log sees every call, refused ones too; then the key check runs: a call
        # without its key is refused whatever it carries.
        self.access = access or AccessLog(settings.access_log, settings.access_log_format)
        logged = [AccessInterceptor(self.access)] if self.access.enabled else []
        if tracing is not None and tracing.enabled:
            logged.append(TracingInterceptor(tracing))
        inference_keys = interceptors(keys, "inference", REPOSITORY_METHODS)
        self.inference = grpc.aio.server(options=options, interceptors=[*logged, *inference_keys])
        self.management = grpc.aio.server(
            options=options, interceptors=[*logged, *interceptors(keys, "management")]
        )
        self._health: list[health.aio.HealthServicer] = []
        # Every servicer through `register`: requests that do not parse are INVALID_ARGUMENT.
        register(
            self.inference,
            oip_grpc.add_GRPCInferenceServiceServicer_to_server,
            InferenceServicer(dataplane, repository, keys),
        )
        register(
            self.inference,
            ts_grpc.add_InferenceAPIsServiceServicer_to_server,
            TorchServeInferenceServicer(dataplane),
        )
        register(
            self.management,
            mgmt_grpc.add_ManagementAPIsServiceServicer_to_server,
            ManagementServicer(management),
        )
        for server, services in ((self.inference, [_OIP, _TS]), (self.management, [_MGMT])):
            checker = health.aio.HealthServicer()
            register(server, health_pb2_grpc.add_HealthServicer_to_server, checker)
            self._health.append(checker)
            names = [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
            register(
                server,
                reflection_pb2_grpc.add_ServerReflectionServicer_to_server,
                reflection.aio.ReflectionServicer([*names, reflection.SERVICE_NAME]),
            )
        self._services = ([_OIP, _TS], [_MGMT])

    def bind(self, inference_address: str, management_address: str) -> tuple[int, int]:
        """Listen on both addresses; returns the bound ports (raises RuntimeError if one fails)."""
        ports = []
        for server, address in (
            (self.inference, inference_address),
            (self.management, management_address),
        ):
            port = server.add_insecure_port(address)
            if port == 0:
                raise RuntimeError(f"cannot listen on {address}")
            ports.append(port)
        return ports[0], ports[1]

    async def start(self) -> None:
        """Listen; the inference port's health is NOT_SERVING until `serving()` is called."""
        await self.inference.start()
        await self.management.start()
        statuses = (
            health_pb2.HealthCheckResponse.NOT_SERVING,
            health_pb2.HealthCheckResponse.SERVING,
        )
        for checker, services, status in zip(self._health, self._services, statuses, strict=True):
            for name in ["", *services]:
                await checker.set(name, status)

    async def serving(self) -> None:
        """The startup models are loaded: the inference port's health turns SERVING."""
        for name in ["", *self._services[0]]:
            await self._health[0].set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        """Draining: every health status turns NOT_SERVING; calls are still answered."""
        for checker, services in zip(self._health, self._services, strict=True):
            for name in ["", *services]:
                await checker.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        for checker in self._health:
            await checker.enter_graceful_shutdown()
        await self.inference.stop(grace_s)
        await self.management.stop(grace_s)
