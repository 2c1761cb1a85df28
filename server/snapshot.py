"""The registered models and their settings, saved on every management change and restored at
the next start (TorchServe's config snapshots, as one JSON file written atomically).

    {"models": [{"name": "tiny", "version": "1.0", "source": "tiny.mar", "default": true,
                 "settings": {"batch_size": 32, "workers": 2, ...}}]}

`source` is relative to the model store when the archive lies in it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scriptserve.server.registry import ModelRegistry, ModelState
from scriptserve.server.settings import ServerSettings

log = logging.getLogger("scriptserve.snapshot")

FILE_NAME = "models.json"


@dataclass(frozen=True)
class SnapshotEntry:
    name: str
    version: str
    source: Path
    default: bool
    settings: dict[str, Any]


def snapshot_path(settings: ServerSettings) -> Path:
    directory = settings.snapshot_dir or settings.model_store / ".snapshot"
    return directory / FILE_NAME


def capture(registry: ModelRegistry, store: Path) -> dict[str, Any]:
    """The registry's ready model versions as the snapshot's JSON document."""
    models = []
    for mv in registry.all_versions():
        if mv.state is not ModelState.READY or mv.settings is None:
            continue
        source = mv.source
        if source.parent.resolve() == store.resolve():
            source = Path(source.name)
        workers = mv.pool.size if mv.pool else mv.settings.workers
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


def write(registry: ModelRegistry, settings: ServerSettings) -> None:
    """Write the snapshot atomically; a store that cannot be written only logs a warning."""
    path = snapshot_path(settings)
    data = json.dumps(capture(registry, settings.model_store), indent=1)
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


def read(settings: ServerSettings) -> list[SnapshotEntry] | None:
    """The snapshot's entries, or None when there is none (or it cannot be used)."""
    path = snapshot_path(settings)
    if not path.is_file():
        return None
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
    return entries
