"""Loading a model version: from an opened archive to running workers, and the heap after it.

`ModelLoader.start` reads the archive's model config, resolves the version's settings, converts
the model to int8 when asked (once, then from the cache), and starts its batcher and workers.
It blocks (handlers load their model), so the registry runs it in a thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from scriptserve.archiver.archive import ArchiveReader
from scriptserve.archiver.manifest import Manifest
from scriptserve.archiver.quantize_cache import load_request, quantize_for_load
from scriptserve.handlers.base import Context
from scriptserve.handlers.loader import handler_class, read_model_config
from scriptserve.server.errors import InvalidInput
from scriptserve.server.models.heap import release_heap
from scriptserve.server.models.memory import Residency, files_size
from scriptserve.server.models.model_settings import ModelSettings
from scriptserve.server.models.model_version import ModelVersion
from scriptserve.server.observability.handler_metrics import read_metrics_config
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.settings import ServerSettings
from scriptserve.server.workers import AnyWorkerPool, RestartPolicy, build_pool
from scriptserve.server.workers.batching import DynamicBatcher

log = logging.getLogger("scriptserve.loading")


class ModelLoader:
    """Turns an opened archive into a ModelVersion, its workers not started yet (the registry
    starts them through `memory.ModelMemory`, which measures what they hold). Blocking."""

    def __init__(
        self, settings: ServerSettings, metrics: ServerMetrics, devices: list[str]
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.devices = devices
        self.metric_declarations = (
            read_metrics_config(settings.metrics_config) if settings.metrics_config else ()
        )

    def start(
        self,
        reader: ArchiveReader,
        *,
        name: str,
        source: Path,
        overrides: dict[str, Any],
        startup: bool = False,
    ) -> ModelVersion:
        """The version, parked: settings resolved, int8 converted when asked, batcher and worker
        pool made with no worker. When it cannot be, whatever was made is stopped and the
        archive closed; raises ServingError, HandlerError, BackendError, ValueError or OSError."""
        manifest = reader.manifest
        version = manifest.model.model_version
        root = reader.root
        batcher: DynamicBatcher | None = None
        pool: AnyWorkerPool | None = None
        try:
            config = read_model_config(root, manifest)
            cls = handler_class(manifest.model.handler, root, manifest)
            overrides = dict(overrides)
            requested = overrides.pop("quantize", None)
            model_file, manifest = self._quantize(name, version, root, manifest, config, requested)
            gpus = sum(1 for d in self.devices if d.startswith("cuda"))
            try:
                settings = ModelSettings.resolve(
                    self.settings,
                    config,
                    overrides,
                    gpus=gpus,
                    batching=cls.supports_batching,
                    defaults=self.settings.model_config_defaults(name, version),
                )
                devices = settings.devices(self.devices)
            except ValueError as exc:
                raise InvalidInput(str(exc)) from None
            context = Context(
                model_name=name,
                model_version=version,
                model_dir=root,
                manifest=manifest,
                model_config=config,
                batch_size=settings.batch_size,
                intra_op_threads=self.settings.intra_op_threads,
                model_file=model_file,
                workers=settings.workers,
                metric_declarations=self.metric_declarations,
                service_envelope=self.settings.service_envelope,
                tensorrt_cache=(
                    self.settings.tensorrt_cache_dir / f"{name}-{version}"
                    if self.settings.tensorrt_cache_dir is not None
                    else None
                ),
            )
            batcher = DynamicBatcher(
                settings.batch_size, settings.max_batch_delay_ms / 1000.0, settings.queue_size
            )
            s = self.settings
            pool = build_pool(
                mode=settings.worker_mode,
                context=context,
                batcher=batcher,
                devices=devices,
                metrics=self.metrics.for_version(name, version),
                response_timeout_s=settings.response_timeout_s,
                policy=RestartPolicy(
                    backoff_s=s.worker_restart_backoff_s,
                    backoff_max_s=s.worker_restart_backoff_max_s,
                    max_restarts=s.worker_max_restarts,
                    restart_window_s=s.worker_restart_window_s,
                    stop_grace_s=s.worker_stop_grace_s,
                ),
                max_abandoned=s.max_abandoned_threads,
                warmup_runs=settings.warmup_runs,
            )
        except BaseException:
            if batcher is not None:
                batcher.close()
            if pool is not None:
                pool.stop()
            reader.close()
            raise
        files = model_files_size(root, manifest, model_file)
        return ModelVersion(
            name=name,
            version=version,
            source=source,
            manifest=manifest,
            settings=settings,
            reader=reader,
            batcher=batcher,
            pool=pool,
            request_signature=cls.request_signature(manifest.signature),
            explains=cls.explains,
            streams=cls.streams(),
            loaded_at_startup=startup,
            handler_metrics=context.metrics,
            residency=Residency(
                lazy=settings.load == "lazy",
                evictable=settings.evictable,
                estimate_bytes=files,
                files_bytes=files,
                parked=True,
            ),
        )

    def _quantize(
        self,
        name: str,
        version: str,
        root: Path,
        manifest: Manifest,
        config: dict[str, Any],
        requested: str | None,
    ) -> tuple[Path | None, Manifest]:
        """The int8 file to serve when the config or the registration asks for it (converted
        once, then taken from the cache), and the manifest that records it."""
        request = load_request(config, requested, threads=self.settings.intra_op_threads)
        if request is None:
            return None, manifest
        cache = self.settings.quantize_cache_dir or self.settings.model_store / ".cache" / "int8"
        model_file, manifest = quantize_for_load(root, manifest, cache, request)
        q = manifest.scriptserve.quantization if manifest.scriptserve else None
        if q is not None and q.details.get("appliedAt") == "load":
            log.info(
                "model=%s version=%s serves dynamic int8 (%s): %.2fx smaller, %.2fx faster",
                name,
                version,
                "from cache" if q.details.get("cached") else "converted",
                q.size_ratio or 0,
                q.latency_ratio or 0,
            )
        return model_file, manifest


def model_files_size(root: Path, manifest: Manifest, model_file: Path | None) -> int:
    """What a version's model files hold on disk: its first load's estimate of its memory."""
    if model_file is not None:
        return files_size([model_file])
    if manifest.model.serialized_file:
        return files_size([root / manifest.model.serialized_file])
    return files_size([root])


def stop_version(mv: ModelVersion, timeout_s: float) -> None:
    """Blocking: stop the version's workers (after their batch, within `timeout_s`), close its
    archive, and give the heap back what only the collector can free."""
    mv.batcher.close()
    mv.pool.stop(timeout_s)
    mv.reader.close()
    release_heap(mv.pool)
