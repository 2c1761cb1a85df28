"""Protocol-neutral operations: what REST routes and gRPC methods translate to and from.

Inference submits to the model version's batcher and awaits the worker's answer on the loop;
the deadline is enforced here with a timer, so a client gets 504 on time whatever the worker does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from scriptserve import __version__
from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.server.batching import DynamicBatcher, Job
from scriptserve.server.description import ModelMetadata, describe_version, quantization_parameters
from scriptserve.server.errors import (
    DeadlineExceeded,
    InvalidInput,
    MethodNotAllowed,
    ModelNotReady,
    ServingError,
    error_for_status,
)
from scriptserve.server.metrics import ServerMetrics
from scriptserve.server.registry import ModelRegistry, ModelState, ModelVersion
from scriptserve.server.security import fetch_archive, is_url
from scriptserve.server.settings import ServerSettings

log = logging.getLogger("scriptserve.dataplane")

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
SERVER_NAME = "scriptserve"
EXTENSIONS = ("binary_tensor_data",)
UNKNOWN_LABEL = "_unknown"
"""Metric label of a model or version the registry does not hold (no model name starts with _)."""
CLIENT_CLOSED = 499
"""Metric status of a request whose client went away first (nginx's "client closed request")."""
DEADLINE_SLACK_S = 0.05
"""How near its deadline a call counts as expired: the client's timer and the server's differ by
the network's latency, so a client's cancel may arrive just before the server's deadline."""
_PLATFORMS = {"torchscript": "pytorch_torchscript", "onnx": "onnxruntime_onnx"}


def _expire(job: Job, batcher: DynamicBatcher, timeout_s: float) -> None:
    if not job.future.done():
        batcher.cancel(job)
        job.future.set_exception(
            DeadlineExceeded(f"no answer within the request's deadline of {timeout_s:g} s")
        )


class DataPlane:
    def __init__(
        self, registry: ModelRegistry, metrics: ServerMetrics, settings: ServerSettings
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.settings = settings
        self.starting = True
        """Until the models named at startup have all been loaded (or have failed)."""
        self.draining = False
        self._background: set[asyncio.Task[Any]] = set()
        self._inflight: dict[tuple[str, str], int] = {}
        """Requests submitted and not yet answered, per (model, version)."""
        self.on_change: Callable[[], None] | None = None
        """Called after every management change (the snapshot writer)."""

    @property
    def inflight(self) -> int:
        """Requests accepted for inference and not yet answered, across every model."""
        return sum(self._inflight.values())

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- health and metadata -----------------------------------------------------------------
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Ready for traffic: started, not draining, and every model that should be loaded is
        ready (the registry only holds the startup models it has begun loading)."""
        return not self.starting and not self.draining and self.registry.healthy()

    def model_ready(self, name: str, version: str | None = None) -> bool:
        return not self.draining and self.registry.get(name, version).ready

    def resolve_version(self, name: str, version: str | None) -> str:
        """The version a request for (name, version) is served by: the default when None."""
        return self.registry.get(name, version).version

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        mv = self.registry.get(name, version)
        assert mv.manifest is not None
        signature = mv.manifest.signature
        return ModelMetadata(
            name=mv.name,
            versions=[v.version for v in self.registry.versions(name)],
            platform=_PLATFORMS[mv.manifest.model_format],
            inputs=signature.inputs,
            outputs=signature.outputs,
            parameters=quantization_parameters(mv),
        )

    # -- inference ---------------------------------------------------------------------------
    async def infer(
        self,
        name: str,
        version: str | None,
        request: InferenceRequest,
        protocol: str,
        timeout_s: float | None = None,
    ) -> InferenceResponse:
        """Run one request; raises a ServingError subclass on any failure."""
        started = time.perf_counter()
        status = 500
        label_version: str | None = None
        try:
            if self.draining:
                raise ModelNotReady("the server is shutting down; retry on another replica")
            mv = self._serving(name, version)
            label_version = mv.version
            key = (mv.name, mv.version)
            self._inflight[key] = self._inflight.get(key, 0) + 1
            try:
                response = await self._submit(mv, request, timeout_s)
            finally:
                left = self._inflight[key] - 1
                if left:
                    self._inflight[key] = left
                else:
                    del self._inflight[key]
            if response.error is not None:
                raise error_for_status(response.status, response.error)
            status = 200
            return response
        except ServingError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            # The client cancelled, or its own deadline ended the call first: not a server error.
            elapsed = time.perf_counter() - started
            expired = timeout_s is not None and elapsed >= timeout_s - DEADLINE_SLACK_S
            status = DeadlineExceeded.status if expired else CLIENT_CLOSED
            raise
        finally:
            self.metrics.observe_request(
                *self._labels(name, label_version), protocol, status, time.perf_counter() - started
            )

    def start(
        self,
        name: str,
        version: str | None,
        request: InferenceRequest,
        protocol: str,
        timeout_s: float | None = None,
    ) -> asyncio.Future[InferenceResponse]:
        """Queue one request and return the future of its answer, without a coroutine per
        request: what a stream of many requests uses. Errors come as the future's exception
        (a ServingError), and an answer whose `error` is set is a failure too
        (`error_for_status`); cancelling the future withdraws the request. Metrics and the
        in-flight count are kept as `infer` keeps them."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            if self.draining:
                raise ModelNotReady("the server is shutting down; retry on another replica")
            mv = self._serving(name, version)
            job, timer = self._enqueue(mv, request, timeout_s)
        except ServingError as exc:
            self.metrics.observe_request(
                *self._labels(name, None), protocol, exc.status, time.perf_counter() - started
            )
            failed: asyncio.Future[InferenceResponse] = loop.create_future()
            failed.set_exception(exc)
            return failed
        batcher = mv.batcher
        assert batcher is not None
        key = (mv.name, mv.version)
        self._inflight[key] = self._inflight.get(key, 0) + 1

        def finished(future: asyncio.Future[InferenceResponse]) -> None:
            timer.cancel()
            left = self._inflight[key] - 1
            if left:
                self._inflight[key] = left
            else:
                del self._inflight[key]
            if future.cancelled():
                batcher.cancel(job)  # the stream ended: free the slot, leave the worker be
                status = CLIENT_CLOSED
            elif (error := future.exception()) is not None:
                status = error.status if isinstance(error, ServingError) else 500
            else:
                response = future.result()
                status = 200
                if response.error is not None:
                    status = error_for_status(response.status, response.error).status
            self.metrics.observe_request(
                mv.name, mv.version, protocol, status, time.perf_counter() - started
            )

        job.future.add_done_callback(finished)
        return job.future

    def _labels(self, name: str, version: str | None) -> tuple[str, str]:
        if version is not None:
            return name, version
        # Clients choose these names: a typo must not mint a new time series.
        return (name if name in self.registry.names() else UNKNOWN_LABEL), UNKNOWN_LABEL

    def _serving(self, name: str, version: str | None) -> ModelVersion:
        mv = self.registry.get(name, version)
        if mv.state is ModelState.FAILED:
            raise ModelNotReady(f"model {name!r} failed: {mv.reason}")
        if not mv.serving or mv.batcher is None:
            raise ModelNotReady(f"model {name!r} has no ready worker; retry later")
        return mv

    async def _submit(
        self, mv: ModelVersion, request: InferenceRequest, timeout_s: float | None
    ) -> InferenceResponse:
        assert mv.batcher is not None
        job, timer = self._enqueue(mv, request, timeout_s)
        try:
            return await job.future
        except asyncio.CancelledError:
            mv.batcher.cancel(job)  # the client went away: free the slot, leave the worker be
            raise
        finally:
            timer.cancel()

    def _enqueue(
        self, mv: ModelVersion, request: InferenceRequest, timeout_s: float | None
    ) -> tuple[Job, asyncio.TimerHandle]:
        """Queue the request with its deadline, and the timer that answers 504 at it."""
        assert mv.batcher is not None and mv.settings is not None
        budget = mv.settings.response_timeout_s
        if timeout_s is not None:
            if timeout_s <= 0:
                raise DeadlineExceeded("the request's deadline passed before it was queued")
            budget = min(budget, timeout_s)  # a client may shorten the deadline, never lengthen
        loop = asyncio.get_running_loop()
        job = Job(request, loop.create_future(), deadline=time.monotonic() + budget)
        mv.batcher.submit(job)
        return job, loop.call_later(budget, _expire, job, mv.batcher, budget)

    # -- management --------------------------------------------------------------------------
    async def register(
        self,
        url: str,
        model_name: str | None = None,
        overrides: dict[str, Any] | None = None,
        synchronous: bool = True,
    ) -> tuple[bool, str]:
        """Load an archive from the model store. Returns (done, message); not done = accepted."""
        if not self.settings.enable_model_api:
            raise MethodNotAllowed(
                "registering models is disabled; start the server with --enable-model-api"
            )
        downloaded = is_url(url)
        if downloaded:
            source = await fetch_archive(url, self.settings)
        else:
            source = self.registry.resolve_source(url)
        if synchronous:
            try:
                mv = await self.registry.load(source, model_name, overrides)
            except ServingError:
                if downloaded:
                    source.unlink(missing_ok=True)
                raise
            self._changed()
            workers = mv.pool.size if mv.pool else 0
            return True, (
                f'Model "{mv.name}" Version: {mv.version} registered with {workers} initial workers'
            )
        task = asyncio.create_task(self._register_later(source, model_name, overrides, downloaded))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return False, "Processing worker updates..."

    async def _register_later(
        self,
        source: Path,
        model_name: str | None,
        overrides: dict[str, Any] | None,
        downloaded: bool = False,
    ) -> None:
        try:
            await self.registry.load(source, model_name, overrides)
        except ServingError as exc:
            log.error("asynchronous registration of %s failed: %s", source.name, exc.message)
            if downloaded:
                source.unlink(missing_ok=True)
        else:
            self._changed()

    async def _scale_later(self, mv: ModelVersion, workers: int) -> None:
        try:
            await self.registry.scale(mv, workers)
        except ServingError as exc:
            log.error("model=%s scaling to %d workers failed: %s", mv.name, workers, exc.message)
        else:
            self._changed()

    async def scale(
        self, name: str, version: str | None, workers: int, synchronous: bool = False
    ) -> tuple[bool, str]:
        mv = self.registry.get(name, version)
        if synchronous:
            await self.registry.scale(mv, workers)
            self._changed()
            return True, f"Workers scaled to {workers} for model: {mv.name}, version: {mv.version}"
        task = asyncio.create_task(self._scale_later(mv, workers))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return False, "Processing worker updates..."

    async def unregister(self, name: str, version: str | None) -> str:
        if not self.settings.enable_model_api:
            raise MethodNotAllowed(
                "unregistering models is disabled; start the server with --enable-model-api"
            )
        mv = await self.registry.unload(name, version, self.settings.drain_timeout_s)
        self._changed()
        return f'Model "{mv.name}" version {mv.version} unregistered'

    def set_default(self, name: str, version: str) -> str:
        self.registry.set_default(name, version)
        self._changed()
        return f'Default version successfully updated for model "{name}" to "{version}"'

    def describe(self, name: str, version: str | None = None) -> list[dict[str, Any]]:
        """TorchServe's describe shape; `version` None = default, "all" = every version."""
        if version == "all":
            versions = self.registry.versions(name)
        elif version is None and name in self.registry.names():
            default = self.registry.default_version(name)
            versions = (
                [self.registry.get(name, default)] if default else self.registry.versions(name)
            )
        else:
            versions = [self.registry.get(name, version)]
        return [
            describe_version(
                mv,
                self.registry.default_version(mv.name) == mv.version,
                self._inflight.get((mv.name, mv.version), 0),
            )
            for mv in versions
        ]

    def list_models(self, limit: int = 100, next_page_token: int = 0) -> dict[str, Any]:
        if not 1 <= limit <= 1000:
            raise InvalidInput("limit must be between 1 and 1000")
        if next_page_token < 0:
            raise InvalidInput("next_page_token must be >= 0")
        names = self.registry.names()
        page = names[next_page_token : next_page_token + limit]
        body: dict[str, Any] = {
            "models": [
                {"modelName": n, "modelUrl": self.registry.versions(n)[0].source.name} for n in page
            ]
        }
        if next_page_token + limit < len(names):
            body["nextPageToken"] = str(next_page_token + limit)
        return body

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the accepted ones; True if all were answered."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.inflight

    async def close(self) -> None:
        """Stop taking traffic, let queues drain, stop every model."""
        self.draining = True
        await self.registry.close(self.settings.drain_timeout_s)


def _json_default(value: Any) -> Any:
    """What orjson cannot write itself: non-contiguous arrays, numpy scalars, odd dtypes."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def prediction_payload(response: InferenceResponse) -> tuple[bytes, str]:
    """The bytes and content type of a TorchServe-style prediction (REST and gRPC alike)."""
    if isinstance(response.body, (bytes, bytearray)):
        return bytes(response.body), response.content_type or "application/octet-stream"
    if response.body is not None:
        content_type = response.content_type or "application/json"
        return orjson.dumps(response.body, default=_json_default, option=_NUMPY), content_type
    # orjson writes numpy arrays directly, without a tolist() round trip.
    outputs = response.outputs
    value: Any = next(iter(outputs.values())) if len(outputs) == 1 else outputs
    return orjson.dumps(value, default=_json_default, option=_NUMPY), "application/json"
