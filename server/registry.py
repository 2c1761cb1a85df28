"""ModelRegistry: the model versions a server holds, their state, and their default version.

Loading (unpacking, verifying, building handlers) is blocking and runs in a thread; the
registry's maps are only changed on the event loop. A version that fails to load is kept with its
reason, so it shows in describe and health, and never affects the other models.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from scriptserve.archiver.archive import ArchiveError, ArchiveReader, open_archive
from scriptserve.archiver.manifest import Manifest, ManifestError, check_model_name
from scriptserve.archiver.quantize_cache import load_request, quantize_for_load
from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import BaseHandler, Context, HandlerError
from scriptserve.handlers.loader import handler_class, load_handler, read_model_config
from scriptserve.server.batching import DynamicBatcher
from scriptserve.server.errors import (
    Conflict,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ServingError,
)
from scriptserve.server.metrics import ServerMetrics, VersionStats
from scriptserve.server.procchild import ChildSpec
from scriptserve.server.procworkers import ProcessWorkerPool, RestartPolicy
from scriptserve.server.settings import ModelSettings, ServerSettings
from scriptserve.server.workers import WorkerPool

log = logging.getLogger("scriptserve.registry")

ARCHIVE_SUFFIXES = (".mar", ".tar.gz", ".tgz")


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic collector's sight.

    A loaded model leaves ~200k long-lived objects (torch, the handler, the model); each full
    collection walked them all, taking up to ~140 ms of GIL time under load. Frozen objects are
    still freed by reference counting; `unload` unfreezes so cycles of a dropped model go too.
    """
    gc.collect()
    gc.freeze()


class ModelState(str, Enum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"


@dataclass(eq=False)
class ModelVersion:
    name: str
    version: str
    source: Path
    state: ModelState = ModelState.LOADING
    reason: str | None = None
    loaded_at_startup: bool = False
    settings: ModelSettings | None = None
    manifest: Manifest | None = None
    reader: ArchiveReader | None = None
    batcher: DynamicBatcher | None = None
    pool: WorkerPool | ProcessWorkerPool | None = None
    loaded_at: float = field(default_factory=time.time)

    @property
    def serving(self) -> bool:
        """Requests are accepted: loaded, and at least one worker able to run them."""
        return self.state is ModelState.READY and self.pool is not None and self.pool.live > 0

    @property
    def ready(self) -> bool:
        """Readiness: serving at full capacity (no worker missing, e.g. one being replaced)."""
        return self.serving and self.pool is not None and self.pool.live >= self.pool.size


def find_archives(store: Path) -> list[Path]:
    """Every archive in the model store: .mar, .tar.gz and no-archive directories."""
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


def archive_stem(path: Path) -> str:
    name = path.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class ModelRegistry:
    def __init__(
        self, settings: ServerSettings, metrics: ServerMetrics, devices: list[str]
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.devices = devices
        self._versions: dict[str, dict[str, ModelVersion]] = {}
        self._defaults: dict[str, str] = {}
        self._failed: dict[str, ModelVersion] = {}
        self._loading: set[tuple[str, str]] = set()

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

    def versions(self, name: str) -> list[ModelVersion]:
        if name in self._versions:
            return list(self._versions[name].values())
        if name in self._failed:
            return [self._failed[name]]
        raise ModelNotFound(f"model {name!r} is not registered")

    def default_version(self, name: str) -> str | None:
        return self._defaults.get(name)

    def all_versions(self) -> Iterator[ModelVersion]:
        for versions in self._versions.values():
            yield from versions.values()
        yield from self._failed.values()

    def healthy(self) -> bool:
        """Every model that should be loaded is ready (TorchServe's /ping)."""
        versions = list(self.all_versions())
        return all(mv.ready for mv in versions)

    def stats(self) -> Iterator[VersionStats]:
        for mv in self.all_versions():
            yield VersionStats(
                mv.name,
                mv.version,
                mv.state.value,
                mv.batcher.depth if mv.batcher else 0,
                mv.pool.counts() if mv.pool else {},
            )

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
    ) -> ModelVersion:
        """Load an archive and start its workers. Raises ServingError; never leaves it half-up."""
        label = name or archive_stem(source)
        try:
            reader = await asyncio.to_thread(open_archive, source)
        except (ArchiveError, ManifestError, OSError) as exc:
            return self._fail(label, "?", source, str(exc), startup)
        manifest = reader.manifest
        try:
            name = check_model_name(name or manifest.model.model_name)
        except ManifestError as exc:
            reader.close()
            raise InvalidInput(str(exc)) from None
        version = manifest.model.model_version
        key = (name, version)
        if version in self._versions.get(name, {}) or key in self._loading:
            reader.close()
            raise Conflict(f"model {name!r} version {version!r} is already registered")
        mv = ModelVersion(name, version, source, loaded_at_startup=startup, manifest=manifest)
        mv.reader = reader
        self._loading.add(key)
        try:
            await asyncio.to_thread(self._start, mv, overrides or {})
        except (ServingError, HandlerError, BackendError, ValueError, OSError) as exc:
            message = exc.message if isinstance(exc, (ServingError, HandlerError)) else str(exc)
            self._stop(mv)
            if isinstance(exc, ServingError) and not startup:
                raise
            return self._fail(name, version, source, message, startup)
        finally:
            self._loading.discard(key)
        mv.state = ModelState.READY
        freeze_heap()
        self._versions.setdefault(name, {})[version] = mv
        self._defaults.setdefault(name, version)
        self._failed.pop(name, None)
        log.info(
            "model=%s version=%s loaded: %d workers, batch %d, delay %g ms",
            name, version, mv.pool.size if mv.pool else 0,
            mv.settings.batch_size if mv.settings else 0,
            mv.settings.max_batch_delay_ms if mv.settings else 0,
        )  # fmt: skip
        return mv

    def _fail(
        self, name: str, version: str, source: Path, reason: str, startup: bool
    ) -> ModelVersion:
        log.error("model=%s version=%s failed to load: %s", name, version, reason)
        mv = ModelVersion(name, version, source, ModelState.FAILED, reason, startup)
        if not startup:
            # The client sent an archive that does not load: its error, reported to it alone.
            # Remembering it would turn the server unready for one bad upload.
            raise InvalidInput(f"model {name!r} failed to load: {reason}")
        if name not in self._versions:
            self._failed[name] = mv
        return mv

    def _start(self, mv: ModelVersion, overrides: dict[str, Any]) -> None:
        """Blocking part of a load: read config, build handlers, start workers."""
        assert mv.reader is not None and mv.manifest is not None
        root, manifest = mv.reader.root, mv.manifest
        config = read_model_config(root, manifest)
        cls = handler_class(manifest.model.handler, root, manifest)
        gpus = sum(1 for d in self.devices if d.startswith("cuda"))
        overrides = dict(overrides)
        model_file, manifest = self._quantize(mv, config, overrides.pop("quantize", None))
        try:
            settings = ModelSettings.resolve(
                self.settings, config, overrides, gpus=gpus, batching=cls.supports_batching,
                defaults=self.settings.model_config_defaults(mv.name, mv.version),
            )  # fmt: skip
            devices = settings.devices(self.devices)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        mv.settings = settings

        def build(device: str) -> tuple[BaseHandler, Context]:
            context = Context(
                model_name=mv.name,
                model_version=mv.version,
                model_dir=root,
                manifest=manifest,
                model_config=config,
                device=device,
                batch_size=settings.batch_size,
                intra_op_threads=self.settings.intra_op_threads,
                model_file=model_file,
            )
            return load_handler(context), context

        mv.batcher = DynamicBatcher(
            settings.batch_size, settings.max_batch_delay_ms / 1000.0, settings.queue_size
        )
        metrics = self.metrics.for_version(mv.name, mv.version)
        if settings.worker_mode == "process":
            spec = ChildSpec.for_model(
                mv.name, mv.version, root, manifest, config,
                settings.batch_size, self.settings.intra_op_threads,
            )  # fmt: skip
            spec = replace(spec, model_file=str(model_file) if model_file else None)
            s = self.settings
            policy = RestartPolicy(
                s.worker_restart_backoff_s, s.worker_restart_backoff_max_s,
                s.worker_max_restarts, s.worker_restart_window_s, s.worker_stop_grace_s,
            )  # fmt: skip
            mv.pool = ProcessWorkerPool(
                mv.name, mv.version, mv.batcher, spec, devices, metrics,
                settings.response_timeout_s, policy, on_failed=lambda r: self._failed_at_run(mv, r),
            )  # fmt: skip
        else:
            mv.pool = WorkerPool(
                mv.name, mv.version, mv.batcher, build, devices, metrics,
                response_timeout_s=settings.response_timeout_s,
                max_abandoned=self.settings.max_abandoned_threads,
                on_failed=lambda r: self._failed_at_run(mv, r),
            )  # fmt: skip
        mv.pool.scale(settings.workers)

    def _quantize(
        self, mv: ModelVersion, config: dict[str, Any], requested: str | None
    ) -> tuple[Path | None, Manifest]:
        """The int8 file to serve when the config or the registration asks for it (converted
        once, then taken from the cache), and the manifest that records it."""
        assert mv.reader is not None and mv.manifest is not None
        request = load_request(config, requested, threads=self.settings.intra_op_threads)
        if request is None:
            return None, mv.manifest
        cache = self.settings.quantize_cache_dir or self.settings.model_store / ".cache" / "int8"
        model_file, mv.manifest = quantize_for_load(mv.reader.root, mv.manifest, cache, request)
        q = mv.manifest.scriptserve.quantization if mv.manifest.scriptserve else None
        if q is not None and q.details.get("appliedAt") == "load":
            log.info(
                "model=%s version=%s serves dynamic int8 (%s): %.2fx smaller, %.2fx faster",
                mv.name, mv.version, "from cache" if q.details.get("cached") else "converted",
                q.size_ratio or 0, q.latency_ratio or 0,
            )  # fmt: skip
        return model_file, mv.manifest

    def _failed_at_run(self, mv: ModelVersion, reason: str) -> None:
        """A loaded version's workers keep failing (called from a worker thread)."""
        log.error("model=%s version=%s marked FAILED: %s", mv.name, mv.version, reason)
        mv.reason = reason
        mv.state = ModelState.FAILED

    def _stop(self, mv: ModelVersion, timeout_s: float = 30.0) -> None:
        if mv.batcher is not None:
            mv.batcher.close()
        if mv.pool is not None:
            mv.pool.stop(timeout_s)
        if mv.reader is not None:
            mv.reader.close()

    async def scale(self, mv: ModelVersion, workers: int) -> None:
        if workers < 0:
            raise InvalidInput("the number of workers must be >= 0")
        if mv.pool is None:
            raise ModelNotReady(f"model {mv.name!r} is not loaded")
        await asyncio.to_thread(mv.pool.scale, workers)

    async def unload(
        self, name: str, version: str | None, drain_s: float, force: bool = False
    ) -> ModelVersion:
        """Stop routing to a version, let its queue drain, then stop its workers."""
        if version is None and name in self._failed and name not in self._versions:
            return self._failed.pop(name)
        mv = self.get(name, version)
        versions = self._versions[name]
        if not force and self._defaults.get(name) == mv.version and len(versions) > 1:
            raise Conflict(
                f"version {mv.version!r} is the default of model {name!r}; "
                "set another default version first"
            )
        mv.state = ModelState.UNLOADING
        del versions[mv.version]
        if not versions:
            del self._versions[name]
            del self._defaults[name]
        deadline = time.monotonic() + drain_s
        while mv.batcher and mv.batcher.depth and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self._stop, mv, max(0.0, deadline - time.monotonic()))
        gc.unfreeze()
        freeze_heap()
        return mv

    def set_default(self, name: str, version: str) -> None:
        self.get(name, version)
        self._defaults[name] = version

    async def close(self, drain_s: float) -> None:
        """Stop every model: queues drain first, within `drain_s` in all."""
        for name in list(self._versions):
            for version in list(self._versions.get(name, {})):
                await self.unload(name, version, drain_s, force=True)
