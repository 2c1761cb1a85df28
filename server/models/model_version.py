"""A model version the registry holds: one that loaded (`ModelVersion`), or one that did not
(`FailedVersion`, kept with its reason when it was named at startup).

A loaded version always has its manifest, settings and batcher, and its workers unless it is
parked (`Residency`: registered lazily, or unloaded to make room; its next request loads it). It
is READY while it serves or can load, FAILED once its workers keep failing (its pool says why),
UNLOADING once unregistered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from scriptserve.archiver.archive import ArchiveReader
from scriptserve.archiver.manifest import Manifest
from scriptserve.handlers.metrics import HandlerMetrics
from scriptserve.handlers.runtime.signature import Signature
from scriptserve.server.models.memory import Residency
from scriptserve.server.models.model_settings import ModelSettings
from scriptserve.server.workers import AnyWorkerPool
from scriptserve.server.workers.batching import DynamicBatcher


class ModelState(str, Enum):
    READY = "READY"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"


@dataclass(eq=False)
class ModelVersion:
    """A loaded model version and its running workers."""

    name: str
    version: str
    source: Path
    manifest: Manifest
    """As served: it records an int8 conversion made at load."""
    settings: ModelSettings
    reader: ArchiveReader
    batcher: DynamicBatcher
    pool: AnyWorkerPool
    request_signature: Signature | None = None
    """What a tensor request must carry, checked before it is queued (None: the handler checks)."""
    explains: bool = False
    """Its handler answers explanation requests (KServe v1's `:explain`)."""
    streams: bool = False
    """Its handler answers in parts (`stream`): only streaming endpoints may call it."""
    loaded_at_startup: bool = False
    handler_metrics: HandlerMetrics = field(default_factory=HandlerMetrics)
    """What its handler counts, times and gauges (`context.metrics`), exported on /metrics."""
    loaded_at: float = field(default_factory=time.time)
    unloading: bool = False
    residency: Residency = field(default_factory=Residency)
    """Whether its workers are up, what they hold, when it was last asked for (memory.py)."""

    @property
    def state(self) -> ModelState:
        if self.unloading:
            return ModelState.UNLOADING
        return ModelState.READY if self.pool.failed_reason is None else ModelState.FAILED

    @property
    def reason(self) -> str | None:
        """Why the version failed while it ran; None while it has not."""
        return self.pool.failed_reason

    @property
    def serving(self) -> bool:
        """Requests are accepted: loaded, and at least one worker able to run them."""
        return self.state is ModelState.READY and self.pool.live > 0

    @property
    def accepting(self) -> bool:
        """Requests may queue: serving, or loaded with its lost workers being replaced (a
        request waits for the replacement, bounded by its deadline, as it would behind a busy
        worker; a model that fails for good answers what is queued at once)."""
        return self.state is ModelState.READY and (self.pool.live > 0 or self.pool.replacing)

    @property
    def ready(self) -> bool:
        """Readiness: serving at full capacity (no worker missing, e.g. one being replaced), or
        parked, which its next request loads."""
        if self.residency.parked:
            return self.state is ModelState.READY
        return self.serving and self.pool.live >= self.pool.size


@dataclass(frozen=True, eq=False)
class FailedVersion:
    """A version that did not load, kept so that describe and health report it. It has no
    manifest, settings, batcher or workers: those read as None."""

    name: str
    version: str
    source: Path
    reason: str
    loaded_at_startup: bool = False
    handler_metrics: HandlerMetrics = field(default_factory=HandlerMetrics)
    """What its handler counts, times and gauges (`context.metrics`), exported on /metrics."""
    loaded_at: float = field(default_factory=time.time)

    state = ModelState.FAILED
    serving = False
    ready = False
    residency = None
    manifest: None = field(default=None, init=False)
    settings: None = field(default=None, init=False)
    batcher: None = field(default=None, init=False)
    pool: None = field(default=None, init=False)


RegisteredVersion = ModelVersion | FailedVersion
"""What the registry lists: loaded versions, and versions named at startup that failed."""
