"""Management operations, protocol-neutral: register, scale, unregister, set the default
version, describe, list, and profile (server/models/profiling.py). The REST management
API and TorchServe's gRPC management service both call these, with the same parameters under
TorchServe's names.

    await management.register(Registration(url="mnist.mar", batch_size=8))
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scriptserve.server.errors import InvalidInput, MethodNotAllowed, ServingError, invalid_fields
from scriptserve.server.models.description import describe_version
from scriptserve.server.models.pipelines import SUFFIX as PIPELINE_SUFFIX
from scriptserve.server.models.pipelines import VERSION as PIPELINE_VERSION
from scriptserve.server.models.profiling import ProfileOptions, Profiler, ProfileResult
from scriptserve.server.models.registry import ModelRegistry, ModelVersion
from scriptserve.server.security import fetch_archive, is_url
from scriptserve.server.settings import ServerSettings

log = logging.getLogger("scriptserve.management")

ACCEPTED = "Processing worker updates..."
"""TorchServe's answer to an asynchronous registration or scaling (HTTP 202)."""


class Registration(BaseModel):
    """A model registration as TorchServe's management API takes it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    url: str = Field(description="archive file name in the model store, or an allowed URL")
    model_name: str | None = Field(None, description="name to serve it under (default: its own)")
    batch_size: int | None = Field(None, ge=1, description="largest batch")
    max_batch_delay: float | None = Field(None, ge=0, description="milliseconds")
    initial_workers: int | None = Field(None, ge=1, description="workers to start")
    response_timeout: float | None = Field(None, gt=0, description="seconds")
    queue_size: int | None = Field(None, ge=1, description="requests that may wait")
    quantize: str | None = Field(None, description="dynamic-int8: convert at load")
    worker_mode: Literal["thread", "process"] | None = Field(
        None, description="thread or process workers"
    )
    load: Literal["eager", "lazy"] | None = Field(
        None, description="lazy: load on the first request; eager: load now"
    )
    evictable: bool | None = Field(
        None, description="false: never unloaded to make room under the memory budget"
    )
    synchronous: bool = Field(True, description="answer once loaded (200) or at once (202)")

    @classmethod
    def parse(cls, values: dict[str, Any]) -> Registration:
        """Validate values taken from a wire message; InvalidInput names each bad one."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise InvalidInput(invalid_fields(exc.errors())) from None

    def overrides(self) -> dict[str, Any]:
        """The model settings this registration sets (None: not given)."""
        return {
            "batch_size": self.batch_size,
            "max_batch_delay_ms": self.max_batch_delay,
            "workers": self.initial_workers,
            "response_timeout_s": self.response_timeout,
            "queue_size": self.queue_size,
            "quantize": self.quantize,
            "worker_mode": self.worker_mode,
            "load": self.load,
            "evictable": self.evictable,
        }


class Scaling(BaseModel):
    """TorchServe's worker range; thread and process pools run max(min, max) workers."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    min_worker: int = Field(1, ge=0)
    max_worker: int | None = Field(None, ge=0)
    synchronous: bool = False

    @classmethod
    def parse(cls, values: dict[str, Any]) -> Scaling:
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise InvalidInput(invalid_fields(exc.errors())) from None

    @property
    def workers(self) -> int:
        return max(self.min_worker, self.max_worker if self.max_worker is not None else 0)


class Management:
    """The management operations over `registry`; `inflight_of(name, version)` counts a
    version's requests accepted and not yet answered (the data plane's, for describe)."""

    def __init__(
        self,
        registry: ModelRegistry,
        inflight_of: Callable[[str, str], int],
        settings: ServerSettings,
    ) -> None:
        self.registry = registry
        self.inflight_of = inflight_of
        self.settings = settings
        self.on_change: Callable[[], None] | None = None
        """Called after every change (the snapshot writer)."""
        self._background: set[asyncio.Task[Any]] = set()
        self.profiler = Profiler()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _later(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _require_model_api(self, what: str) -> None:
        if not self.settings.enable_model_api:
            raise MethodNotAllowed(
                f"{what} models is disabled; start the server with --enable-model-api"
            )

    async def register(self, registration: Registration) -> tuple[bool, str]:
        """Load an archive. Returns (done, message); not done = accepted, loading goes on."""
        self._require_model_api("registering")
        downloaded = is_url(registration.url)
        if downloaded:
            source = await fetch_archive(registration.url, self.settings)
        else:
            source = self.registry.resolve_source(registration.url)
        if source.name.endswith(PIPELINE_SUFFIX):
            pipeline = self.registry.pipelines.load(
                source, registration.model_name, taken=set(self.registry.names())
            )
            self._changed()
            steps = " -> ".join(step.model for step in pipeline.steps)
            return True, f'Pipeline "{pipeline.name}" registered: {steps}'
        if not registration.synchronous:
            self._later(self._register_later(source, registration, downloaded))
            return False, ACCEPTED
        try:
            mv = await self.registry.load(source, registration.model_name, registration.overrides())
        except ServingError:
            if downloaded:
                source.unlink(missing_ok=True)
            raise
        self._changed()
        workers = mv.pool.size if mv.pool else 0
        return True, (
            f'Model "{mv.name}" Version: {mv.version} registered with {workers} initial workers'
        )

    async def _register_later(
        self, source: Path, registration: Registration, downloaded: bool
    ) -> None:
        try:
            await self.registry.load(source, registration.model_name, registration.overrides())
        except ServingError as exc:
            log.error("asynchronous registration of %s failed: %s", source.name, exc.message)
            if downloaded:
                source.unlink(missing_ok=True)
        else:
            self._changed()

    async def scale(self, name: str, version: str | None, scaling: Scaling) -> tuple[bool, str]:
        mv = self.registry.get(name, version)
        workers = scaling.workers
        if mv.settings is not None:
            try:
                mv.settings.check_scale(workers)
            except ValueError as exc:
                raise InvalidInput(str(exc)) from None
        if not scaling.synchronous:
            self._later(self._scale_later(mv, workers))
            return False, ACCEPTED
        await self.registry.scale(mv, workers)
        self._changed()
        return True, f"Workers scaled to {workers} for model: {mv.name}, version: {mv.version}"

    async def _scale_later(self, mv: ModelVersion, workers: int) -> None:
        try:
            await self.registry.scale(mv, workers)
        except ServingError as exc:
            log.error("model=%s scaling to %d workers failed: %s", mv.name, workers, exc.message)
        else:
            self._changed()

    async def unregister(self, name: str, version: str | None) -> str:
        self._require_model_api("unregistering")
        if self.registry.pipelines.get(name) is not None:
            self.registry.pipelines.remove(name)
            self._changed()
            return f'Pipeline "{name}" unregistered'
        mv = await self.registry.unload(name, version, self.settings.drain_timeout_s)
        self._changed()
        return f'Model "{mv.name}" version {mv.version} unregistered'

    def set_default(self, name: str, version: str) -> str:
        self.registry.set_default(name, version)
        self._changed()
        return f'Default version successfully updated for model "{name}" to "{version}"'

    async def profile(
        self, name: str, version: str | None, options: ProfileOptions
    ) -> ProfileResult:
        """A profiler trace of the version's next batches (`version` None: the default)."""
        return await self.profiler.capture(self.registry.get(name, version), options)

    def describe(self, name: str, version: str | None = None) -> list[dict[str, Any]]:
        """TorchServe's describe shape; `version` None = default, "all" = every version. A
        pipeline is described by its steps."""
        pipeline = self.registry.pipelines.get(name)
        if pipeline is not None:
            return [
                {
                    "modelName": name,
                    "modelVersion": PIPELINE_VERSION,
                    "modelUrl": pipeline.source.name,
                    "pipeline": pipeline.describe(),
                }
            ]
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
                self.inflight_of(mv.name, mv.version),
            )
            for mv in versions
        ]

    def list_models(self, limit: int = 100, next_page_token: int = 0) -> dict[str, Any]:
        if not 1 <= limit <= 1000:
            raise InvalidInput("limit must be between 1 and 1000")
        if next_page_token < 0:
            raise InvalidInput("next_page_token must be >= 0")
        pipelines = {p.name: p.source.name for p in self.registry.pipelines.all()}
        names = sorted([*self.registry.names(), *pipelines])
        page = names[next_page_token : next_page_token + limit]
        body: dict[str, Any] = {
            "models": [
                {
                    "modelName": n,
                    "modelUrl": pipelines.get(n) or self.registry.versions(n)[0].source.name,
                }
                for n in page
            ]
        }
        if next_page_token + limit < len(names):
            body["nextPageToken"] = str(next_page_token + limit)
        return body
