"""How a model version is described to clients: TorchServe's describe record, OIP metadata, and
whether it serves an int8 model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scriptserve.archiver.signature import TensorSpec
from scriptserve.server.registry import RegisteredVersion


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: list[str]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: dict[str, Any] = field(default_factory=dict)
    """`quantization` and, for int8, how it was made (docs/quantization.md)."""


def quantization_parameters(mv: RegisteredVersion) -> dict[str, Any]:
    """Flat OIP-style parameters saying whether a version serves an int8 model."""
    info = mv.manifest.scriptserve if mv.manifest else None
    if info is None or not info.quantization.quantized:
        return {"quantization": "none"}
    q = info.quantization
    found = {
        "quantization": q.mode,
        "quantization_applied_at": q.details.get("appliedAt"),
        "quantization_source_sha256": q.source_sha256,
        "quantization_size_ratio": q.size_ratio,
        "quantization_latency_ratio": q.latency_ratio,
        "quantization_max_abs_diff": q.max_abs_diff,
    }
    return {k: v for k, v in found.items() if v is not None}


def describe_version(mv: RegisteredVersion, is_default: bool, inflight: int) -> dict[str, Any]:
    """TorchServe's describe record of one version, with scriptserve's additions."""
    s = mv.settings
    manifest = mv.manifest
    pending = mv.batcher.depth if mv.batcher else 0
    return {
        "modelName": mv.name,
        "modelVersion": mv.version,
        "modelUrl": mv.source.name,
        "runtime": manifest.runtime if manifest else "python",
        "modelFormat": manifest.model_format if manifest else None,
        "quantization": manifest.scriptserve.quantization.mode
        if manifest and manifest.scriptserve
        else "none",
        "quantizationInfo": manifest.scriptserve.quantization.to_dict()
        if manifest and manifest.scriptserve
        else {"mode": "none"},
        "state": mv.state.value,
        "reason": mv.reason,
        "isDefault": is_default,
        "minWorkers": mv.pool.size if mv.pool else 0,
        "maxWorkers": max(s.max_workers or 0, mv.pool.size) if s and mv.pool else 0,
        "batchSize": s.batch_size if s else None,
        "maxBatchDelay": s.max_batch_delay_ms if s else None,
        "responseTimeout": s.response_timeout_s if s else None,
        "deviceType": s.device_type if s else None,
        "workerMode": s.worker_mode if s else None,
        "deviceIds": list(s.device_ids) if s and s.device_ids is not None else None,
        "warmupRuns": s.warmup_runs if s else None,
        "loadedAtStartup": mv.loaded_at_startup,
        "workers": mv.pool.describe() if mv.pool else [],
        "jobQueueStatus": {
            "remainingCapacity": (s.queue_size - pending) if s else 0,
            "pendingRequests": pending,
            "inFlightRequests": inflight,
        },
    }
