"""`MAR-INF/MANIFEST.json`: TorchServe's keys plus a `scriptserve` section.

TorchServe's `torch-model-archiver` writes::

    {"createdOn": "17/03/2025 10:00:00", "runtime": "python", "archiverVersion": "0.12.0",
     "model": {"modelName": "m", "modelVersion": "1.0", "serializedFile": "model.pt",
               "handler": "image_classifier", ...}}

scriptserve archives add `"scriptserve": {"modelFormat": ..., "files": {name: sha256}, ...}`.
Archives without that section (made by TorchServe) still load: the format then comes from the
serialized file's extension.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal

from scriptserve import __version__
from scriptserve.handlers.runtime.signature import Signature, SignatureError

MANIFEST_PATH = "MAR-INF/MANIFEST.json"
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$")
CREATED_ON_FORMAT = "%d/%m/%Y %H:%M:%S"
FORMAT_VERSION = 1

ModelFormat = Literal["pt2", "torchscript", "onnx"]
MODEL_FORMATS: tuple[ModelFormat, ...] = ("pt2", "torchscript", "onnx")
_FORMAT_BY_SUFFIX: dict[str, ModelFormat] = {
    ".pt2": "pt2",
    ".pt": "torchscript",
    ".pth": "torchscript",
    ".torchscript": "torchscript",
    ".onnx": "onnx",
}


class ManifestError(ValueError):
    """A manifest that is missing, malformed or inconsistent; the message says what to fix."""


def check_model_name(name: str) -> str:
    """Return `name` if it is a valid model name, else raise ManifestError."""
    if not MODEL_NAME_PATTERN.fullmatch(name):  # match() lets `$` pass a trailing newline
        raise ManifestError(
            f"invalid model name {name!r}: use letters, digits, '_', '-' and '.', "
            "starting with a letter or digit"
        )
    return name


def format_for_file(filename: str) -> ModelFormat:
    """The model format implied by a serialized file's extension."""
    lower = filename.lower()
    for suffix, fmt in _FORMAT_BY_SUFFIX.items():
        if lower.endswith(suffix):
            return fmt
    raise ManifestError(
        f"cannot tell the model format of {filename!r}: "
        "expected an AOTInductor package (.pt2), a TorchScript file (.pt, .pth) or an ONNX "
        "file (.onnx)"
    )


@dataclass(frozen=True)
class Quantization:
    """How the serialized model was quantized; `mode` is "none" for a float model.

    For `dynamic-int8` (archiver/quantize.py): the SHA-256 of the fp32 model it came from, and
    fp32/int8 ratios of file size and latency plus the largest output difference, measured on
    the sample input. `details` holds the rest (ops converted, engine, options, validation).
    """

    mode: str = "none"
    details: dict[str, Any] = field(default_factory=dict)
    source_sha256: str | None = None
    size_ratio: float | None = None
    latency_ratio: float | None = None
    max_abs_diff: float | None = None

    _KEYS = {
        "sourceSha256": "source_sha256",
        "sizeRatio": "size_ratio",
        "latencyRatio": "latency_ratio",
        "maxAbsDiff": "max_abs_diff",
    }

    @property
    def quantized(self) -> bool:
        return self.mode != "none"

    def to_dict(self) -> dict[str, Any]:
        measured = {k: getattr(self, a) for k, a in self._KEYS.items()}
        return {
            "mode": self.mode,
            **{k: v for k, v in measured.items() if v is not None},
            **self.details,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Quantization:
        if not data:
            return cls()
        rest = {k: v for k, v in data.items() if k != "mode" and k not in cls._KEYS}
        sha = data.get("sourceSha256")
        numbers: dict[str, float | None] = {}
        for key in ("sizeRatio", "latencyRatio", "maxAbsDiff"):
            value = data.get(key)
            if value is not None and not isinstance(value, (int, float)):
                raise ManifestError(f"manifest scriptserve.quantization.{key} must be a number")
            numbers[cls._KEYS[key]] = float(value) if value is not None else None
        return cls(str(data.get("mode", "none")), rest, str(sha) if sha else None, **numbers)


@dataclass(frozen=True)
class Pt2Target:
    """The machine a `.pt2` package was compiled for.

    On CPU, `isa` is the vector instruction set Inductor compiled its kernels for
    ("AVX512 AVX512_VNNI"), `march` the compiler's -march, and `cpu_flags` the CPU features the
    compiled code may use, as `torch.cpu.get_capabilities()` names them; on CUDA, `cuda_arch` is
    the GPU architecture ("sm_90").
    """

    device: str = "cpu"
    isa: str | None = None
    march: str | None = None
    cpu_flags: tuple[str, ...] = ()
    cuda_arch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        raw = {
            "device": self.device,
            "isa": self.isa,
            "march": self.march,
            "cpuFlags": list(self.cpu_flags) if self.device == "cpu" else None,
            "cudaArch": self.cuda_arch,
        }
        return {k: v for k, v in raw.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any) -> Pt2Target:
        if not isinstance(data, dict) or data.get("device") not in ("cpu", "cuda"):
            raise ManifestError("manifest scriptserve.pt2.target.device must be 'cpu' or 'cuda'")
        flags = data.get("cpuFlags", [])
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise ManifestError("manifest scriptserve.pt2.target.cpuFlags must be a list of names")
        return cls(
            device=data["device"],
            isa=_optional_str(data.get("isa")),
            march=_optional_str(data.get("march")),
            cpu_flags=tuple(flags),
            cuda_arch=_optional_str(data.get("cudaArch")),
        )


@dataclass(frozen=True)
class Pt2Info:
    """How a `.pt2` package (torch.export + AOTInductor) was built, and what serving it needs:
    the same torch release, the target device and instruction set, a batch of at most
    `max_batch` rows (None: no bound was exported) and, for a model of token sequences exported
    with a dynamic sequence, at most `max_seq_len` positions (dim 1 of the inputs whose
    signature leaves it -1).

    `source` says where the package came from: "package" (made by the user), "eager" (a model
    class and its state dict) or "exported-program" (saved with torch.export.save).
    """

    torch_version: str
    target: Pt2Target
    max_batch: int | None = None
    compile_options: dict[str, Any] = field(default_factory=dict)
    source: str = "package"
    max_seq_len: int | None = None
    precision: str = "fp32"
    """The precision the compiled model computes in (archiver/precision.py); its inputs and
    outputs stay float32."""
    precision_check: dict[str, Any] = field(default_factory=dict)
    """For bf16/fp16: the instructions used and the accuracy guard's figures against fp32."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "torchVersion": self.torch_version,
            "target": self.target.to_dict(),
            "maxBatch": self.max_batch,
            "compileOptions": dict(self.compile_options),
            "source": self.source,
        }
        if self.max_seq_len is not None:
            data["maxSeqLen"] = self.max_seq_len
        if self.precision != "fp32":
            data["precision"] = self.precision
            data["precisionCheck"] = dict(self.precision_check)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Pt2Info:
        if not isinstance(data, dict):
            raise ManifestError("manifest scriptserve.pt2 must be an object")
        version = data.get("torchVersion")
        if not isinstance(version, str) or not version:
            raise ManifestError("manifest scriptserve.pt2.torchVersion is missing")
        bounds = {
            key: _positive_or_none(data.get(key), f"scriptserve.pt2.{key}")
            for key in ("maxBatch", "maxSeqLen")
        }
        options = data.get("compileOptions") or {}
        if not isinstance(options, dict):
            raise ManifestError("manifest scriptserve.pt2.compileOptions must be an object")
        return cls(
            torch_version=version,
            target=Pt2Target.from_dict(data.get("target")),
            max_batch=bounds["maxBatch"],
            compile_options=dict(options),
            source=str(data.get("source", "package")),
            max_seq_len=bounds["maxSeqLen"],
            precision=str(data.get("precision") or "fp32"),
            precision_check=dict(data.get("precisionCheck") or {}),
        )


def _optional_str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


def _positive_or_none(value: Any, key: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ManifestError(f"manifest {key} must be a positive integer")
    return value


@dataclass(frozen=True)
class ModelInfo:
    """The `model` object of TorchServe's manifest."""

    model_name: str
    model_version: str
    handler: str
    serialized_file: str | None = None
    model_file: str | None = None
    requirements_file: str | None = None
    config_file: str | None = None
    extensions: str | None = None

    def to_dict(self) -> dict[str, Any]:
        raw = {
            "modelName": self.model_name,
            "modelVersion": self.model_version,
            "handler": self.handler,
            "serializedFile": self.serialized_file,
            "modelFile": self.model_file,
            "requirementsFile": self.requirements_file,
            "configFile": self.config_file,
            "extensions": self.extensions,
        }
        return {k: v for k, v in raw.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        for key in ("modelName", "handler"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise ManifestError(f"manifest model.{key} is missing or not a string")
        return cls(
            model_name=data["modelName"],
            model_version=str(data.get("modelVersion", "1.0")),
            handler=data["handler"],
            serialized_file=data.get("serializedFile") or None,
            model_file=data.get("modelFile") or None,
            requirements_file=data.get("requirementsFile") or None,
            config_file=data.get("configFile") or None,
            extensions=data.get("extensions") or None,
        )


@dataclass(frozen=True)
class ScriptserveInfo:
    """The `scriptserve` section: what TorchServe's manifest cannot say."""

    model_format: ModelFormat
    files: dict[str, str]
    signature: Signature = field(default_factory=Signature)
    quantization: Quantization = field(default_factory=Quantization)
    sample_input: str | None = None
    # Labelled inputs to check accuracy with, e.g. after int8: an .npz of one array per input
    # name plus "labels" (read with np.load(..., allow_pickle=False)).
    validation_samples: str | None = None
    # Measured figures, e.g. {"testAccuracy": 0.98, "testSamples": 270} (made by training/).
    metrics: dict[str, Any] = field(default_factory=dict)
    pt2: Pt2Info | None = None
    """How a `pt2` model was built and what serving it needs; None for other formats."""
    max_seq_len: int | None = None
    """The longest sequence (dim 1 of the token inputs) a TorchScript or ONNX model takes, as
    `--max-seq-len` gave it: text handlers truncate to it. A `.pt2` keeps its own in `pt2`."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "formatVersion": FORMAT_VERSION,
            "modelFormat": self.model_format,
            "files": dict(sorted(self.files.items())),
            "signature": self.signature.to_dict(),
            "quantization": self.quantization.to_dict(),
        }
        if self.sample_input:
            data["sampleInput"] = self.sample_input
        if self.validation_samples:
            data["validationSamples"] = self.validation_samples
        if self.metrics:
            data["metrics"] = dict(self.metrics)
        if self.pt2 is not None:
            data["pt2"] = self.pt2.to_dict()
        if self.max_seq_len is not None:
            data["maxSeqLen"] = self.max_seq_len
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScriptserveInfo:
        fmt = data.get("modelFormat")
        if fmt not in MODEL_FORMATS:
            raise ManifestError(f"manifest scriptserve.modelFormat must be one of {MODEL_FORMATS}")
        files = data.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()
        ):
            raise ManifestError("manifest scriptserve.files must map file names to SHA-256 hex")
        try:
            signature = Signature.from_dict(data.get("signature") or {})
        except SignatureError as exc:
            raise ManifestError(f"manifest scriptserve.signature: {exc}") from None
        return cls(
            model_format=fmt,
            files=dict(files),
            signature=signature,
            quantization=Quantization.from_dict(data.get("quantization")),
            sample_input=data.get("sampleInput") or None,
            validation_samples=data.get("validationSamples") or None,
            metrics=dict(data["metrics"]) if isinstance(data.get("metrics"), dict) else {},
            pt2=Pt2Info.from_dict(data["pt2"]) if data.get("pt2") is not None else None,
            max_seq_len=_positive_or_none(data.get("maxSeqLen"), "scriptserve.maxSeqLen"),
        )


@dataclass(frozen=True)
class Manifest:
    """A whole `MANIFEST.json`. `scriptserve` is None for archives made by TorchServe."""

    model: ModelInfo
    created_on: str = field(
        default_factory=lambda: datetime.now(timezone.utc).strftime(CREATED_ON_FORMAT)
    )
    runtime: str = "python"
    archiver_version: str = __version__
    scriptserve: ScriptserveInfo | None = None

    @property
    def model_format(self) -> ModelFormat:
        """The model format: recorded by scriptserve, else implied by the serialized file."""
        if self.scriptserve is not None:
            return self.scriptserve.model_format
        if not self.model.serialized_file:
            raise ManifestError("the manifest names no serialized model file")
        return format_for_file(self.model.serialized_file)

    @property
    def signature(self) -> Signature:
        return self.scriptserve.signature if self.scriptserve else Signature()

    def with_scriptserve(self, info: ScriptserveInfo) -> Manifest:
        return replace(self, scriptserve=info)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "createdOn": self.created_on,
            "runtime": self.runtime,
            "model": self.model.to_dict(),
            "archiverVersion": self.archiver_version,
        }
        if self.scriptserve is not None:
            data["scriptserve"] = self.scriptserve.to_dict()
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError("the manifest must be a JSON object")
        model = data.get("model")
        if not isinstance(model, dict):
            raise ManifestError("the manifest has no 'model' object")
        section = data.get("scriptserve")
        if section is not None and not isinstance(section, dict):
            raise ManifestError("manifest 'scriptserve' must be an object")
        return cls(
            model=ModelInfo.from_dict(model),
            created_on=str(data.get("createdOn", "")),
            runtime=str(data.get("runtime", "python")),
            archiver_version=str(data.get("archiverVersion", "")),
            scriptserve=ScriptserveInfo.from_dict(section) if section is not None else None,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{MANIFEST_PATH} is not valid JSON: {exc}") from None
        return cls.from_dict(data)
