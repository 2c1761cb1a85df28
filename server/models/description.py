"""How the server and its model versions are described to clients: OIP server and model
metadata, Triton's model configuration and statistics, TorchServe's describe record, and
whether a version serves an int8 model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scriptserve import __version__
from scriptserve.handlers.runtime.signature import Signature, TensorSpec
from scriptserve.server.errors import ModelNotReady
from scriptserve.server.models.model_configuration import model_configuration
from scriptserve.server.models.pipelines import VERSION as PIPELINE_VERSION
from scriptserve.server.models.pipelines import tensor_specs
from scriptserve.server.models.registry import ModelRegistry, ModelVersion, RegisteredVersion
from scriptserve.server.observability.metrics import ServerMetrics

SERVER_NAME = "scriptserve"
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics", "model_repository")
"""The Open Inference Protocol extensions the server implements (Triton's names), on REST and
gRPC alike."""

_PLATFORMS = {
    "pt2": "pytorch_aotinductor",
    "torchscript": "pytorch_torchscript",
    "onnx": "onnxruntime_onnx",
}
"""OIP's `platform` (`<framework>_<format>`) by model format."""


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


def memory_parameters(mv: RegisteredVersion) -> dict[str, Any]:
    """Flat OIP-style parameters saying whether a version is loaded and what it holds."""
    if mv.residency is None:
        return {}
    r = mv.residency
    return {
        "residence": r.state.value,
        "load": "lazy" if r.lazy else "eager",
        "evictable": r.evictable,
        "resident_bytes": r.resident_bytes,
    }


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
        "memory": mv.residency.describe() if mv.residency else None,
        "jobQueueStatus": {
            "remainingCapacity": (s.queue_size - pending) if s else 0,
            "pendingRequests": pending,
            "inFlightRequests": inflight,
        },
    }


class Descriptions:
    """What the server says about itself and the models its registry holds, read-only: OIP's
    metadata, Triton's configuration and statistics, KServe v1's model list. Both transports
    reach it as `DataPlane.descriptions`."""

    def __init__(self, registry: ModelRegistry, metrics: ServerMetrics) -> None:
        self.registry = registry
        self.metrics = metrics

    def model_names(self) -> list[str]:
        """Every registered model and pipeline, ready or not (KServe v1's model list)."""
        return sorted([*self.registry.names(), *self.registry.pipelines.names()])

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        pipeline = self.registry.pipelines.get(name)
        if pipeline is not None:
            inputs, outputs = tensor_specs(pipeline, self._signature_of)
            return ModelMetadata(name, [PIPELINE_VERSION], "ensemble", inputs, outputs)
        mv = self.registry.get(name, version)
        if mv.manifest is None:
            raise ModelNotReady(f"model {name!r} failed to load: {mv.reason}")
        signature = mv.manifest.signature
        return ModelMetadata(
            name=mv.name,
            versions=[v.version for v in self.registry.versions(name)],
            platform=_PLATFORMS.get(mv.manifest.model_format, mv.manifest.model_format),
            inputs=signature.inputs,
            outputs=signature.outputs,
            parameters=quantization_parameters(mv) | self._memory_parameters(mv),
        )

    def _memory_parameters(self, mv: RegisteredVersion) -> dict[str, Any]:
        """Where models come and go (a memory budget, or this one lazy): its residence."""
        lazy = mv.residency is not None and mv.residency.lazy
        return memory_parameters(mv) if lazy or self.registry.memory.budget_bytes else {}

    def _signature_of(self, name: str, version: str | None) -> Signature:
        mv = self.registry.get(name, version)
        if mv.manifest is None:
            raise ModelNotReady(f"model {name!r} failed to load: {mv.reason}")
        return mv.manifest.signature

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's model configuration of a version, as JSON
        (`server/models/model_configuration.py`)."""
        meta = self.model_metadata(name, version)
        mv = self.registry.get(name, version)
        parameters = {"worker_mode": mv.settings.worker_mode, **meta.parameters}
        return model_configuration(mv, meta.platform, parameters)

    def statistics(self, name: str | None = None, version: str | None = None) -> list[Any]:
        """Triton's statistics (`server/observability/statistics.py`) of every loaded version,
        of every version of model `name`, or of one version."""
        if name is None:
            versions = [mv for mv in self.registry.all_versions() if isinstance(mv, ModelVersion)]
        elif version is None:
            versions = [mv for mv in self.registry.versions(name) if isinstance(mv, ModelVersion)]
            if not versions:
                self.registry.get(name)  # says why the model has none (it failed to load)
        else:
            versions = [self.registry.get(name, version)]
        versions.sort(key=lambda mv: (mv.name, mv.version))
        return [self.metrics.statistics_of(mv.name, mv.version).snapshot() for mv in versions]
