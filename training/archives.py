"""Pack an exported model into a served archive through the archiver's Python API.

Each archive holds the model file, `index_to_name.json`, `preprocessing.json` (what the
`image_classifier` handler does to an image before the model sees it), `sample.json` (one input
instance, for warm-up and checks), `validation.npz` (labelled test inputs, for the int8 accuracy
guard) and `model-config.yaml`; the manifest records the signature (probed by running the
sample), the quantization, the validation file and the measured test accuracy.

>>> build_model_archive(exported, ArchiveContents(...), Path("model_store"), "digits")
PosixPath('model_store/digits.mar')
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from scriptserve.archiver.archive import ArchiveFormat, ArchiveSpec, build_archive
from scriptserve.archiver.manifest import (
    Manifest,
    ModelInfo,
    Quantization,
    ScriptserveInfo,
    format_for_file,
)
from scriptserve.archiver.model_file import probe_model
from scriptserve.training.export import INPUT_NAME, Exported

HANDLER = "image_classifier"
ARCHIVE_SUFFIX = {
    "pt2": "",
    "pt2-int8": "-int8",
    "torchscript": "-torchscript",
    "traced": "-traced",
    "onnx": "-onnx",
    "torchscript-int8": "-torchscript-int8",
}
"""Archive names by format: the `.pt2` archives are the model's own name (`digits.mar`,
`digits-int8.mar`); the deprecated TorchScript and ONNX ones say what they hold."""


@dataclass(frozen=True)
class ArchiveContents:
    """What every archive of one training run shares."""

    class_names: tuple[str, ...]
    preprocessing: dict[str, Any]
    sample: np.ndarray  # one instance with its batch dim, (1, 1, 32, 32)
    validation_inputs: np.ndarray
    validation_labels: np.ndarray
    version: str = "1.0"
    model_config: dict[str, Any] = field(default_factory=dict)


def archive_name(base: str, fmt: str) -> str:
    return f"{base}{ARCHIVE_SUFFIX[fmt]}"


def write_support_files(contents: ArchiveContents, folder: Path) -> dict[str, Path]:
    """The files every archive carries besides its model, by their name in the archive."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "index_to_name.json": folder / "index_to_name.json",
        "preprocessing.json": folder / "preprocessing.json",
        "sample.json": folder / "sample.json",
        "validation.npz": folder / "validation.npz",
        "model-config.yaml": folder / "model-config.yaml",
    }
    index = {str(i): name for i, name in enumerate(contents.class_names)}
    files["index_to_name.json"].write_text(json.dumps(index, indent=2) + "\n")
    files["preprocessing.json"].write_text(json.dumps(contents.preprocessing, indent=2) + "\n")
    files["sample.json"].write_text(json.dumps(contents.sample[0].tolist()))
    with files["validation.npz"].open("wb") as fh:
        arrays = {
            INPUT_NAME: contents.validation_inputs.astype(np.float32),
            "labels": contents.validation_labels.astype(np.int64),
        }
        np.savez_compressed(fh, **arrays)  # type: ignore[arg-type]
    files["model-config.yaml"].write_text(yaml.safe_dump(contents.model_config, sort_keys=True))
    return files


def build_model_archive(
    exported: Exported,
    contents: ArchiveContents,
    support: dict[str, Path],
    export_path: Path,
    base_name: str,
    metrics: dict[str, Any],
) -> Path:
    """Write `<export_path>/<name>.mar` for one exported model and return its path."""
    model_format = format_for_file(exported.path.name)
    signature = probe_model(exported.path, model_format, {INPUT_NAME: contents.sample})
    name = archive_name(base_name, exported.fmt)
    serialized = f"model{exported.path.suffix}"
    files = {serialized: exported.path, **support}
    quantization = exported.quantization if exported.quantization is not None else Quantization()
    manifest = Manifest(
        model=ModelInfo(
            model_name=name,
            model_version=contents.version,
            handler=HANDLER,
            serialized_file=serialized,
            config_file="model-config.yaml",
        ),
        scriptserve=ScriptserveInfo(
            model_format=model_format,
            files={},
            signature=signature,
            quantization=quantization,
            sample_input="sample.json",
            validation_samples="validation.npz",
            metrics=metrics,
            pt2=exported.pt2,
        ),
    )
    return build_archive(
        ArchiveSpec(manifest, files), export_path, ArchiveFormat.DEFAULT, force=True
    )
