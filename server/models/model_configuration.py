"""A served model version as Triton's model configuration (its model configuration extension).

The configuration is filled from what the server really runs, never from defaults it does not
apply: the batcher's largest batch (`max_batch_size`), the signature's tensors with Triton's
`TYPE_*` datatypes (without the batch dimension when the model batches), the batcher's delay
and queue as `dynamic_batching`, the workers as instance groups (count and CPU/GPU), and the
transaction policy: decoupled (any number of answers per request, Triton's word for a model that
streams) when the model's handler answers in parts. The answer is
the JSON form of Triton's `ModelConfig` (model_config.proto): the REST route returns it as it is,
the gRPC method parses it into the message.

    config = model_configuration(mv, platform="pytorch_torchscript", parameters={})
    config["max_batch_size"], config["input"][0]["dims"]   # 32, [8]
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from scriptserve.handlers.runtime.signature import TensorSpec
from scriptserve.server.models.model_version import ModelVersion
from scriptserve.server.workers.pool import WorkerState

TRITON_DATATYPES = {
    "BOOL": "TYPE_BOOL",
    "UINT8": "TYPE_UINT8",
    "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64",
    "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16",
    "FP32": "TYPE_FP32",
    "FP64": "TYPE_FP64",
    "BYTES": "TYPE_STRING",
    "BF16": "TYPE_BF16",
}
"""Open Inference Protocol datatypes as Triton's model-configuration DataType names."""
_BACKENDS = {"torchscript": "pytorch", "pt2": "pytorch", "onnx": "onnxruntime"}
_US = 1_000_000


def _batches(specs: tuple[TensorSpec, ...]) -> bool:
    """The model takes a batch dimension first: every tensor's leading dimension is variable."""
    return all(spec.shape and spec.shape[0] == -1 for spec in specs)


def _dims(spec: TensorSpec, batched: bool) -> list[int]:
    return list(spec.shape[1:] if batched else spec.shape)


def _instance_groups(mv: ModelVersion) -> list[dict[str, Any]]:
    """The running workers by device: one CPU group, GPU groups by count per GPU (a Triton
    group with `gpus` [0, 1] and count 2 means two instances on each of them)."""
    devices = Counter(s.device for s in mv.pool.slots() if s.state is not WorkerState.STOPPED)
    cpu = sum(count for device, count in devices.items() if not device.startswith("cuda"))
    groups: list[tuple[str, int, list[int]]] = [("KIND_CPU", cpu, [])] if cpu else []
    per_gpu = {
        int(device.partition(":")[2] or 0): count
        for device, count in devices.items()
        if device.startswith("cuda")
    }
    if per_gpu and len(set(per_gpu.values())) == 1:
        groups.append(("KIND_GPU", next(iter(per_gpu.values())), sorted(per_gpu)))
    else:
        groups.extend(("KIND_GPU", count, [gpu]) for gpu, count in sorted(per_gpu.items()))
    return [
        {"name": f"{mv.name}_{i}", "kind": kind, "count": count, "gpus": gpus}
        for i, (kind, count, gpus) in enumerate(groups)
    ]


def model_configuration(
    mv: ModelVersion, platform: str, parameters: dict[str, Any]
) -> dict[str, Any]:
    """Triton's ModelConfig of a loaded version, as JSON (enum values by name)."""
    signature = mv.manifest.signature
    settings = mv.settings
    batched = _batches(signature.inputs + signature.outputs)
    config: dict[str, Any] = {
        "name": mv.name,
        "platform": platform,
        "backend": _BACKENDS.get(mv.manifest.model_format, mv.manifest.model_format),
        # Every registered version is served, each under its own name.
        "version_policy": {"all": {}},
        "max_batch_size": settings.batch_size if batched else 0,
        "input": [
            {
                "name": spec.name,
                "data_type": TRITON_DATATYPES[spec.datatype],
                "format": "FORMAT_NONE",
                "dims": _dims(spec, batched),
                "is_shape_tensor": False,
                "allow_ragged_batch": False,
                "optional": False,
            }
            for spec in signature.inputs
        ],
        "output": [
            {
                "name": spec.name,
                "data_type": TRITON_DATATYPES[spec.datatype],
                "dims": _dims(spec, batched),
                "label_filename": "",
                "is_shape_tensor": False,
            }
            for spec in signature.outputs
        ],
        "instance_group": _instance_groups(mv),
        "default_model_filename": mv.manifest.model.serialized_file or "",
        "parameters": {key: {"string_value": str(value)} for key, value in parameters.items()},
        "model_transaction_policy": {"decoupled": mv.streams},
    }
    if settings.batch_size > 1:
        config["dynamic_batching"] = {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(settings.max_batch_delay_ms * 1000),
            "preserve_ordering": False,
            "priority_levels": 0,
            "default_priority_level": 0,
            "default_queue_policy": {
                # A request past its deadline in the queue is answered 504, never run; a client
                # may shorten its deadline (X-Request-Timeout, a gRPC deadline), never lengthen.
                "timeout_action": "REJECT",
                "default_timeout_microseconds": round(settings.response_timeout_s * _US),
                "allow_timeout_override": True,
                "max_queue_size": settings.queue_size,
            },
        }
    return config
