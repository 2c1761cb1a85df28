"""The registered models and their settings, saved on every management change and restored at
the next start (TorchServe's config snapshots), one JSON file per replica, written atomically.

    {"models": [{"name": "tiny", "version": "1.0", "source": "tiny.mar", "default": true,
                 "settings": {"batch_size": 32, "workers": 2, ...}}]}

`source` is relative to the model store when the archive lies in it. Replicas sharing a volume
each keep `<snapshot_dir>/models-<snapshot_id>.json` (the id defaults to the host name) and
restore only their own. The single `models.json` of earlier versions is taken over, once, by
the first replica that starts without a file of its own (see `read`). In `declarative` mode
there are no snapshots: the configured models are the only source.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scriptserve.server.models.registry import ModelRegistry, ModelState
from scriptserve.server.settings import ServerSettings

log = logging.getLogger("scriptserve.snapshot")

LEGACY_FILE_NAME = "models.json"
"""The one snapshot file every replica shared before snapshots were per replica."""


@dataclass(frozen=True)
class SnapshotEntry:
    name: str
    version: str
    source: Path
    default: bool
    settings: dict[str, Any]


def enabled(settings: ServerSettings) -> bool:
    """Whether this replica records and restores snapshots (not in declarative mode)."""
    return settings.snapshot_mode == "per-replica"


def replica_id(settings: ServerSettings) -> str:
    """`snapshot_id`, else the host name made safe for a file name."""
    if settings.snapshot_id:
        return settings.snapshot_id
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-")
    return host[:200] or "localhost"


def snapshot_dir(settings: ServerSettings) -> Path:
    return settings.snapshot_dir or settings.model_store / ".snapshot"


def snapshot_path(settings: ServerSettings) -> Path:
    """This replica's snapshot file."""
    return snapshot_dir(settings) / f"models-{replica_id(settings)}.json"


def capture(registry: ModelRegistry, store: Path) -> dict[str, Any]:
    """The registry's ready model versions as the snapshot's JSON document."""
    models = []
    for mv in registry.all_versions():
        if mv.state is not ModelState.READY or mv.settings is None:
            continue
        source = mv.source
        if source.parent.resolve() == store.resolve():
            source = Path(source.name)
        parked = mv.residency is not None and mv.residency.parked
        workers = mv.pool.size if mv.pool and not parked else mv.settings.workers
        entry = mv.settings.model_copy(update={"workers": max(1, workers)}).model_dump(mode="json")
        info = mv.manifest.scriptserve if mv.manifest else None
        if info is not None and info.quantization.details.get("appliedAt") == "load":
            entry["quantize"] = info.quantization.mode  # converted again at restore (cached)
        models.append(
            {
                "name": mv.name,
                "version": mv.version,
                "source": str(source),
                "default": registry.default_version(mv.name) == mv.version,
                "settings": entry,
            }
        )
    return {"models": models}


def recorder(registry: ModelRegistry, settings: ServerSettings) -> Callable[[], None] | None:
    """What to call after every management change: a writer of this replica's snapshot, or
    None in declarative mode."""
    if not enabled(settings):
        return None
    return lambda: write(registry, settings)


def write(registry: ModelRegistry, settings: ServerSettings) -> None:
    """Write this replica's snapshot atomically: a reader sees the old file or the new one,
    never part of one. A store that cannot be written only logs a warning."""
    path = snapshot_path(settings)
    data = json.dumps(capture(registry, settings.model_store), indent=1)
    # Hidden and not ending in .json: never taken for a snapshot by a reader listing the folder.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("w") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("cannot write the model snapshot to %s: %s", path, exc.strerror)
        return
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    """Make the rename itself survive a crash of the machine (best effort: some filesystems
    cannot sync a directory, and the file's own data is synced already)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read(settings: ServerSettings) -> list[SnapshotEntry] | None:
    """This replica's snapshot entries, or None when it has none (or it cannot be used).

    A replica without a file of its own takes over the legacy `models.json` when there is one,
    by renaming it to its own file name: a single-replica deployment upgrading keeps its models,
    and of several replicas starting at once exactly one gets them (the rename is atomic).
    """
    path = snapshot_path(settings)
    if not path.is_file():
        legacy = _adopt_legacy(settings, path)
        if legacy is None:
            return None
        path = legacy
    try:
        doc = json.loads(path.read_text())
        entries = []
        for item in doc["models"]:
            source = Path(item["source"])
            if not source.is_absolute():
                source = settings.model_store / source
            entries.append(
                SnapshotEntry(
                    str(item["name"]),
                    str(item["version"]),
                    source,
                    bool(item["default"]),
                    dict(item["settings"]),
                )
            )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("ignoring the model snapshot %s: %s", path, exc)
        return None
    log.info("restoring %d model version(s) from the snapshot %s", len(entries), path)
    return entries


def _adopt_legacy(settings: ServerSettings, path: Path) -> Path | None:
    """Rename the legacy snapshot to this replica's `path` and return it; None when there is no
    legacy snapshot (or another replica took it first)."""
    legacy = path.with_name(LEGACY_FILE_NAME)
    try:
        os.replace(legacy, path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        # A read-only folder: restore from it anyway, rather than lose the registrations.
        log.warning(
            "cannot rename the legacy model snapshot %s to %s (%s); restoring from it as it is",
            legacy,
            path.name,
            exc.strerror,
        )
        return legacy
    _sync_directory(path.parent)
    log.warning(
        "took over the legacy model snapshot %s as this replica's snapshot %s (snapshot_id %s);"
        " other replicas start without it",
        legacy,
        path.name,
        replica_id(settings),
    )
    return path
