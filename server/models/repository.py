"""Triton's model repository extension (index, load, unload) over the management operations.

The repository is the model store. A model's name there is its archive's name without the
suffix (`mnist.mar`, `mnist.tar.gz`, `mnist.tgz` or a directory `mnist/`), as TorchServe
names the models it loads from a store:

- index lists every model the store holds and every version the server holds (registered from
  the store or from a URL), with Triton's states: READY, UNAVAILABLE (with the reason) or
  UNLOADING; `ready` keeps only the READY ones;
- load registers the store's archive under that name and waits until it serves (the management
  API's synchronous registration); a model already loaded from it stays as it is;
- unload unregisters every version of the model, each after its running requests finish.

Load and unload change what the server runs: like registering and unregistering, they need
`--enable-model-api`, and the adapters ask for the management key.

    await ModelRepository(management).load("mnist", {})
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from scriptserve.handlers.base import HandlerError
from scriptserve.server.errors import Conflict, InvalidInput, ModelNotFound, ModelNotReady
from scriptserve.server.models.management import Management, Registration
from scriptserve.server.models.registry import (
    ModelState,
    ModelVersion,
    RegisteredVersion,
    archive_stem,
    find_archives,
)

log = logging.getLogger("scriptserve.repository")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
UNLOAD_PARAMETERS = frozenset({"unload_dependents"})
"""No model depends on another here, so `unload_dependents` changes nothing."""


def _state(mv: RegisteredVersion) -> tuple[str, str]:
    """Triton's state of a version and the reason it is not READY."""
    if mv.state is ModelState.UNLOADING:
        return UNLOADING, "unloading"
    if isinstance(mv, ModelVersion) and mv.residency.loading is not None:
        return LOADING, "loading for the requests waiting for it"
    if isinstance(mv, ModelVersion) and mv.residency.parked and mv.ready:
        return READY, "not loaded: its next request loads it"
    if mv.ready:
        return READY, ""
    if mv.reason is not None:
        return UNAVAILABLE, mv.reason
    if isinstance(mv, ModelVersion) and mv.pool.size == 0:
        return UNAVAILABLE, "scaled to 0 workers"
    return UNAVAILABLE, "a worker is starting"


def _check_request(
    name: str, what: str, parameters: Mapping[str, Any], allowed: frozenset[str]
) -> None:
    if not name:
        raise InvalidInput(f"{what}: the request names no model")
    for key in parameters:
        if key in allowed:
            continue
        if key == "config" or key.startswith("file:"):
            raise InvalidInput(
                f"{what}: parameter {key!r} is not supported: models load from the archives in "
                "the model store with their own configuration; change workers and batching with "
                "the management API (PUT /models/NAME)"
            )
        raise InvalidInput(f"{what}: unknown parameter {key!r}")


class ModelRepository:
    def __init__(self, management: Management) -> None:
        self.management = management
        self.registry = management.registry

    def _archive(self, name: str) -> str:
        """The file name of the store's archive of model `name`."""
        for path in find_archives(self.management.settings.model_store):
            if archive_stem(path) == name:
                return path.name
        raise ModelNotFound(
            f"the model store has no archive for model {name!r}: add {name}.mar (or "
            f"{name}.tar.gz, or a directory {name}/) to it, or register the model by URL with "
            "the management API"
        )

    def index(self, ready: bool = False) -> list[dict[str, str]]:
        """Triton's index: a `{name, version, state, reason}` entry per model version held,
        and a `{name, state, reason}` one per store model not loaded, sorted by name."""
        entries: list[dict[str, str]] = []
        for mv in self.registry.all_versions():
            state, reason = _state(mv)
            entries.append({"name": mv.name, "version": mv.version, "state": state})
            if reason:
                entries[-1]["reason"] = reason
        held = set(self.registry.names())
        for path in find_archives(self.management.settings.model_store):
            name = archive_stem(path)
            if name not in held:
                entries.append({"name": name, "state": UNAVAILABLE, "reason": "not loaded"})
        if ready:
            entries = [e for e in entries if e["state"] == READY]
        return sorted(entries, key=lambda e: (e["name"], e.get("version", "")))

    async def load(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Load the store's archive of model `name` and wait until it serves (a lazy model too,
        or one unloaded to make room under the memory budget)."""
        _check_request(name, f"loading model {name!r}", parameters, frozenset())
        registration = Registration.parse(
            {"url": self._archive(name), "model_name": name, "load": "eager", "synchronous": True}
        )
        try:
            await self.management.register(registration)
        except Conflict:
            # That archive's version is registered under this name already: loaded, or parked.
            log.info("model=%s load: already registered from the model store", name)
            for mv in self.registry.versions(name):
                if isinstance(mv, ModelVersion) and mv.residency.parked:
                    await self._load_parked(mv)

    async def _load_parked(self, mv: ModelVersion) -> None:
        try:
            await self.registry.memory.load(mv, mv.settings.workers)
        except HandlerError as exc:
            raise ModelNotReady(
                f"model {mv.name!r} version {mv.version} could not load: {exc.message}"
            ) from None

    async def unload(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Unregister every version of model `name`, its default version last."""
        _check_request(name, f"unloading model {name!r}", parameters, UNLOAD_PARAMETERS)
        if name not in self.registry.names():
            raise ModelNotFound(f"model {name!r} is not loaded")
        default = self.registry.default_version(name)
        versions = [mv for mv in self.registry.versions(name) if isinstance(mv, ModelVersion)]
        if not versions:  # only a version that failed to load at startup
            await self.management.unregister(name, None)
            return
        for mv in sorted(versions, key=lambda v: v.version == default):
            await self.management.unregister(name, mv.version)
