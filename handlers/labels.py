"""Class labels and top-k answers, for the classifier handlers (`image_classifier`,
`text_classifier`).

Labels come from the archive's `index_to_name.json` (`{"0": "cat", ...}`, TorchServe's file),
else the `id2label` of a Hugging Face `config.json` packed in the archive, else the class index.
The answer to one row of scores is `{label: probability}` for the `topk` most likely classes
(the request parameter `topk`, else the model config's, default 5), most likely first.

    labels = read_labels(model_dir)
    top_classes(np.array([0.1, 2.0, -1.0]), 2, labels)  # {"dog": 0.80, "cat": 0.18}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from scriptserve.handlers.base import HandlerError

DEFAULT_TOPK = 5
INDEX_TO_NAME = "index_to_name.json"
HF_CONFIG = "config.json"


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file of the archive (labels, a Hugging Face config, preprocessing)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HandlerError(f"the archive's {path.name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HandlerError(f"the archive's {path.name} must hold a JSON object")
    return data


def read_labels(model_dir: Path) -> dict[int, str]:
    """The archive's class labels by index; {} when it has none."""
    names = model_dir / INDEX_TO_NAME
    if names.is_file():
        raw = read_json_object(names)
    elif (model_dir / HF_CONFIG).is_file():
        raw = read_json_object(model_dir / HF_CONFIG).get("id2label") or {}
        if not isinstance(raw, dict):
            raise HandlerError(f"the archive's {HF_CONFIG} has an id2label that is not an object")
    else:
        return {}
    try:
        return {int(k): str(v) for k, v in raw.items()}
    except ValueError:
        raise HandlerError("class labels must be keyed by class index ('0', '1', ...)") from None


def topk(parameters: dict[str, Any], default: int) -> int:
    """The request's `topk` parameter, else `default`; ValueError when it is not a positive
    integer."""
    value = parameters.get("topk", default)
    if isinstance(value, bool):
        raise ValueError("parameter topk must be a positive integer")
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise ValueError("parameter topk must be a positive integer") from None
    if k < 1 or k != float(value):
        raise ValueError("parameter topk must be a positive integer")
    return k


def top_classes(scores: np.ndarray, k: int, labels: dict[int, str]) -> dict[str, float]:
    """The k most likely classes of one row of scores (logits), by label, most likely first."""
    shifted = scores.astype(np.float64) - scores.max()
    probs = np.exp(shifted) / np.exp(shifted).sum()
    order = np.argsort(-probs, kind="stable")[: max(1, k)]
    return {labels.get(int(c), str(int(c))): float(probs[c]) for c in order}
