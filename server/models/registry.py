"""ModelRegistry: the model versions a server holds, their default versions, and their health.

The registry's maps are only changed on the event loop. Everything blocking runs in threads:
opening an archive, loading a version (`model_loading.ModelLoader`), stopping one, the heap's
collection. A version that fails to load at startup is kept with its reason, so it shows in
describe and health, and never affects the other models.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scriptserve.archiver.archive import ArchiveError, open_archive
from scriptserve.archiver.manifest import ManifestError, check_model_name
from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import HandlerError
from scriptserve.handlers.metrics import HandlerMetrics
from scriptserve.server.errors import (
    Conflict,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ServingError,
)
from scriptserve.server.models.heap import freeze_heap
from scriptserve.server.models.memory import ModelMemory
from scriptserve.server.models.model_loading import ModelLoader, stop_version
from scriptserve.server.models.model_version import (
    FailedVersion,
    ModelState,
    ModelVersion,
    RegisteredVersion,
)
from scriptserve.server.models.pipelines import SUFFIX as PIPELINE_SUFFIX
from scriptserve.server.models.pipelines import Pipelines
from scriptserve.server.observability.gauges import WorkerGauge
from scriptserve.server.observability.metrics import ServerMetrics, VersionStats
from scriptserve.server.settings import ServerSettings
from scriptserve.server.workers.pool import WorkerState

__all__ = [
    "FailedVersion",
    "ModelRegistry",
    "ModelState",
    "ModelVersion",
    "RegisteredVersion",
    "archive_stem",
    "find_archives",
]

log = logging.getLogger("scriptserve.registry")

ARCHIVE_SUFFIXES = (".mar", ".tar.gz", ".tgz")


def find_archives(store: Path) -> list[Path]:
    """Every archive in the model store: .mar, .tar.gz and no-archive directories (pipeline
    files are `find_pipelines`')."""
    if not store.is_dir():
        return []
    found = []
    for path in sorted(store.iterdir()):
        if path.name.startswith("."):
            continue
        is_archive = path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES)
        if is_archive or (path / "MAR-INF" / "MANIFEST.json").is_file():
            found.append(path)
    return found


def find_pipelines(store: Path) -> list[Path]:
    """Every pipeline file in the model store (`<name>.pipeline.yaml`)."""
    return sorted(store.glob(f"*{PIPELINE_SUFFIX}")) if store.is_dir() else []


def archive_stem(path: Path) -> str:
    name = path.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _scaled_to_zero(mv: RegisteredVersion) -> bool:
    return isinstance(mv, ModelVersion) and mv.state is ModelState.READY and mv.pool.size == 0


class ModelRegistry:
    def __init__(
        self, settings: ServerSettings, metrics: ServerMetrics, devices: list[str]
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.devices = devices
        self.loader = ModelLoader(settings, metrics, devices)
        self.memory = ModelMemory(settings.memory_budget_bytes(), metrics)
        """The memory budget, and the loads and unloads that keep it."""
        self.memory.watch(self.loaded_versions)
        self.pipelines = Pipelines()
        """Pipelines of the models held here, each served as a model (pipelines.py)."""
        self._versions: dict[str, dict[str, ModelVersion]] = {}
        self._defaults: dict[str, str] = {}
        self._failed: dict[str, FailedVersion] = {}
        self._loading: set[tuple[str, str]] = set()
        self._scaling: weakref.WeakKeyDictionary[ModelVersion, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    # -- lookup -----------------------------------------------------------------------------
    def get(self, name: str, version: str | None = None) -> ModelVersion:
        """The named version, or the default one; raises ModelNotFound / ModelNotReady."""
        versions = self._versions.get(name)
        if not versions:
            if name in self._failed:
                raise ModelNotReady(f"model {name!r} failed to load: {self._failed[name].reason}")
            raise ModelNotFound(f"model {name!r} is not registered")
        if version is None:
            version = self._defaults[name]
        mv = versions.get(version)
        if mv is None:
            known = ", ".join(sorted(versions))
            raise ModelNotFound(f"model {name!r} has no version {version!r} (versions: {known})")
        return mv

    def names(self) -> list[str]:
        return sorted(set(self._versions) | set(self._failed))

    def versions(self, name: str) -> list[RegisteredVersion]:
        if name in self._versions:
            return list(self._versions[name].values())
        if name in self._failed:
            return [self._failed[name]]
        raise ModelNotFound(f"model {name!r} is not registered")

    def default_version(self, name: str) -> str | None:
        return self._defaults.get(name)

    def loaded_versions(self) -> Iterator[ModelVersion]:
        """Every version that loaded, its workers up or parked."""
        for versions in list(self._versions.values()):
            yield from list(versions.values())

    def all_versions(self) -> Iterator[RegisteredVersion]:
        """Every version held, loaded or failed. Read from copies: a metrics scrape reads them
        from a thread while the event loop registers and unregisters."""
        for versions in list(self._versions.values()):
            yield from list(versions.values())
        yield from list(self._failed.values())

    def healthy(self) -> bool:
        """Every model that should be loaded is ready (TorchServe's /ping). A version scaled to
        0 workers does not count: its operator asked for no capacity, and the replica's other
        models must stay in service (its own readiness, and its requests, answer 503)."""
        return all(mv.ready or _scaled_to_zero(mv) for mv in list(self.all_versions()))

    def stats(self) -> Iterator[VersionStats]:
        for mv in self.all_versions():
            if isinstance(mv, ModelVersion):
                yield VersionStats(
                    mv.name,
                    mv.version,
                    mv.state.value,
                    mv.batcher.depth,
                    mv.pool.counts(),
                    mv.residency.resident_bytes,
                )
            else:
                yield VersionStats(mv.name, mv.version, mv.state.value, 0, {})

    def handler_metrics(self) -> Iterator[tuple[str, str, HandlerMetrics]]:
        for mv in self.all_versions():
            if isinstance(mv, ModelVersion):
                yield mv.name, mv.version, mv.handler_metrics

    def worker_gauges(self) -> Iterator[WorkerGauge]:
        for mv in self.all_versions():
            if isinstance(mv, ModelVersion):
                for slot in mv.pool.slots():
                    busy = slot.state is WorkerState.BUSY
                    pid = getattr(slot, "pid", None)  # process workers have their own
                    yield WorkerGauge(mv.name, mv.version, slot.id, busy, pid)

    # -- load / unload ----------------------------------------------------------------------
    def resolve_source(self, url: str) -> Path:
        """An archive named by the client: a file or directory in the model store root."""
        candidate = Path(url)
        if candidate.name != url or url in ("", ".", ".."):
            raise InvalidInput(
                f"url {url!r} must name an archive in the model store (a file name, no path)"
            )
        path = self.settings.model_store / url
        if not path.exists():
            raise ModelNotFound(f"archive {url!r} is not in the model store")
        return path

    async def load(
        self,
        source: Path,
        name: str | None = None,
        overrides: dict[str, Any] | None = None,
        startup: bool = False,
    ) -> RegisteredVersion:
        """Load an archive and start its workers. Raises ServingError; never leaves it half-up.
        At startup a version that does not load is kept (FailedVersion) instead."""
        label = name or archive_stem(source)
        try:
            reader = await asyncio.to_thread(open_archive, source)
        except (ArchiveError, ManifestError, OSError) as exc:
            return self._fail(label, "?", source, str(exc), startup)
        manifest = reader.manifest
        version = manifest.model.model_version
        try:
            name = check_model_name(name or manifest.model.model_name)
        except ManifestError as exc:
            await asyncio.to_thread(reader.close)
            raise InvalidInput(str(exc)) from None
        key = (name, version)
        if version in self._versions.get(name, {}) or key in self._loading:
            await asyncio.to_thread(reader.close)
            raise Conflict(f"model {name!r} version {version!r} is already registered")
        self._loading.add(key)
        mv: ModelVersion | None = None
        try:
            mv = await asyncio.to_thread(
                self.loader.start,
                reader,
                name=name,
                source=source,
                overrides=overrides or {},
                startup=startup,
            )
            if not mv.residency.lazy:
                await self.memory.load(mv, mv.settings.workers)
        except (ServingError, HandlerError, BackendError, ValueError, OSError) as exc:
            if mv is not None:
                await asyncio.to_thread(stop_version, mv, 0.0)
            if isinstance(exc, ServingError) and not startup:
                raise
            message = exc.message if isinstance(exc, (ServingError, HandlerError)) else str(exc)
            return self._fail(name, version, source, message, startup)
        except BaseException:
            if mv is not None:
                await asyncio.to_thread(stop_version, mv, 0.0)
            raise
        finally:
            self._loading.discard(key)
        self._versions.setdefault(name, {})[version] = mv
        self._defaults.setdefault(name, version)
        self._failed.pop(name, None)
        log.info(
            "model=%s version=%s registered: %s, batch %d, delay %g ms",
            name,
            version,
            f"{mv.pool.size} workers" if mv.pool.size else "loads on its first request",
            mv.settings.batch_size,
            mv.settings.max_batch_delay_ms,
        )
        await asyncio.to_thread(freeze_heap)
        return mv

    def _fail(
        self, name: str, version: str, source: Path, reason: str, startup: bool
    ) -> FailedVersion:
        log.error("model=%s version=%s failed to load: %s", name, version, reason)
        if not startup:
            # The client sent an archive that does not load: its error, reported to it alone.
            # Remembering it would turn the server unready for one bad upload.
            raise InvalidInput(f"model {name!r} failed to load: {reason}")
        failed = FailedVersion(name, version, source, reason, loaded_at_startup=True)
        if name not in self._versions:
            self._failed[name] = failed
        return failed

    async def scale(self, mv: ModelVersion, workers: int) -> None:
        """Run `workers` workers. At 0, what waits in the queue is answered 503 at once (the
        requests running finish first): nobody is left to run it."""
        if workers < 0:
            raise InvalidInput("the number of workers must be >= 0")
        # One scaling of a version at a time, in the order asked (asynchronous ones included):
        # the last one asked is the size it ends at.
        async with self._scaling.setdefault(mv, asyncio.Lock()):
            if mv.unloading:
                raise ModelNotFound(f"model {mv.name!r} version {mv.version} was unregistered")
            try:
                if mv.residency.parked and workers > 0:
                    await self.memory.load(mv, workers)  # within the budget, measured
                else:
                    mv.residency.parked = False  # the operator's size: 0 stays 0
                    await asyncio.to_thread(mv.pool.scale, workers)
                    await self.memory.workers_changed(mv)
            except HandlerError as exc:
                raise ServingError(
                    f"model {mv.name!r} version {mv.version} could not start a worker: "
                    f"{exc.message}; it keeps its {mv.pool.size} worker(s)"
                ) from None
            if mv.pool.size == 0:
                # On the loop, where requests are queued: one that found a worker before they
                # left is in the queue now, and any later one is refused (no live worker).
                mv.pool.fail_queued(
                    ModelNotReady(
                        f"model {mv.name!r} version {mv.version} was scaled to 0 workers; scale "
                        f"it up again to serve it (PUT /models/{mv.name}?min_worker=1)"
                    )
                )

    async def unload(
        self, name: str, version: str | None, drain_s: float, force: bool = False
    ) -> RegisteredVersion:
        """Unregister a version: stop routing to it, answer what waits in its queue 503 at once,
        let the requests its workers are running finish (within `drain_s`), then stop them."""
        if version is None and name in self._failed and name not in self._versions:
            return self._failed.pop(name)
        mv = self._remove(name, version, force)
        # Nothing can be queued after this (the version is no longer routed to): what is queued
        # now would only wait for workers that are about to stop.
        mv.pool.fail_queued(
            ModelNotReady(
                f"model {mv.name!r} version {mv.version} was unregistered before this request "
                "ran; retry"
            )
        )
        await asyncio.to_thread(stop_version, mv, drain_s)
        await self.memory.workers_changed(mv)
        return mv

    def _remove(self, name: str, version: str | None, force: bool) -> ModelVersion:
        """Take a version out of the registry (no request is routed to it any more)."""
        mv = self.get(name, version)
        versions = self._versions[name]
        if not force and self._defaults.get(name) == mv.version and len(versions) > 1:
            raise Conflict(
                f"version {mv.version!r} is the default of model {name!r}; "
                "set another default version first"
            )
        mv.unloading = True
        del versions[mv.version]
        if not versions:
            del self._versions[name]
            del self._defaults[name]
        return mv

    def set_default(self, name: str, version: str) -> None:
        self.get(name, version)
        self._defaults[name] = version

    async def close(self, drain_s: float) -> None:
        """Stop every model (the server is shutting down): unlike `unload`, queued requests are
        still run, within `drain_s` in all."""
        deadline = time.monotonic() + drain_s

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        for name in list(self._versions):
            for version in list(self._versions.get(name, {})):
                mv = self._remove(name, version, force=True)
                await asyncio.to_thread(mv.batcher.wait_empty, remaining())
                await asyncio.to_thread(stop_version, mv, remaining())
