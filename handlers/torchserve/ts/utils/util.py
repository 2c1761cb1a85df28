"""`ts.utils.util`: the helpers TorchServe handlers import."""

from __future__ import annotations

import inspect
import json
import logging
import os
from types import ModuleType
from typing import Any

log = logging.getLogger("scriptserve.torchserve")

PT2_AVAILABLE = True


class PredictionException(Exception):
    """Raised by a handler to fail the whole batch with `error_code` as the status."""

    def __init__(self, message: str, error_code: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.error_code = error_code

    def __str__(self) -> str:
        return f"{self.message} : {self.error_code}"


def list_classes_from_module(module: ModuleType, parent_class: type | None = None) -> list[type]:
    """Classes defined in `module` itself (not imported into it), optionally of a base class."""
    classes = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
    ]
    if parent_class is not None:
        return [c for c in classes if issubclass(c, parent_class)]
    return classes


def load_label_mapping(mapping_file_path: str) -> dict[str, Any] | None:
    """`index_to_name.json` as a dict with string keys, or None when the file is absent."""
    if not os.path.isfile(mapping_file_path):
        log.warning("no %s; labels will be class indices", os.path.basename(mapping_file_path))
        return None
    with open(mapping_file_path) as f:
        mapping = json.load(f)
    if not isinstance(mapping, dict):
        raise TypeError("index_to_name.json must hold an object mapping class index to name")
    # Values may be [synset, name] pairs (ImageNet); TorchServe keeps them as given.
    return {str(k): v for k, v in mapping.items()}


def map_class_to_label(
    probs: list[list[float]],
    mapping: dict[str, Any] | None = None,
    lbl_classes: list[list[int]] | None = None,
) -> list[dict[Any, float]]:
    """One `{label: probability}` dict per row; labels from `mapping` when it has them."""
    if not isinstance(probs, list):
        raise TypeError("probs must be a list of rows")
    if lbl_classes is None:
        lbl_classes = [list(range(len(row))) for row in probs]
    if not isinstance(lbl_classes, list):
        raise TypeError("lbl_classes must be a list of rows")

    def label(index: int) -> Any:
        if mapping is None:
            return str(index)
        value = mapping[str(index)]
        # JSON keys must be strings: an ImageNet-style [synset, name] pair becomes its name.
        return value[-1] if isinstance(value, list) else value

    return [
        {label(c): p for c, p in zip(classes, row, strict=True)}
        for classes, row in zip(lbl_classes, probs, strict=True)
    ]


def get_yaml_config(yaml_file_path: str) -> dict[str, Any]:
    import yaml

    with open(yaml_file_path) as f:
        data = yaml.safe_load(f)
    return data if isinstance(data, dict) else {}


def check_valid_pt2_backend(backend: str) -> bool:
    import torch._dynamo

    valid = backend in torch._dynamo.list_backends(exclude_tags=())
    if not valid:
        log.warning("%s is not a supported torch.compile backend", backend)
    return valid
