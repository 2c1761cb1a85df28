"""The int8 accuracy guard: validation samples, int8 compared with fp32, and tolerances.

An archive may carry validation samples (`validation.npz`, named by the manifest's
`scriptserve.validationSamples`): inputs plus labels and/or the fp32 model's outputs. Before an
int8 model is served, `compare` runs both versions on them (top-1 agreement, max abs difference,
accuracy with labels) and `check_tolerance` refuses it when a measure is past its tolerance::

    result = compare(fp32_runner, int8_runner, ValidationSamples.load(path))
    check_tolerance(result, Tolerance(min_top1_agreement=0.99))  # raises QuantizationError

No torch here: runners are callables from named numpy inputs to named numpy outputs.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

VALIDATION_FILE = "validation.npz"

Runner = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
"""A model version: named inputs in, named outputs out."""


class QuantizationError(ValueError):
    """A model that cannot be quantized, or whose int8 version the accuracy guard refuses."""


@dataclass(frozen=True)
class Tolerance:
    """What the accuracy guard accepts on the validation samples."""

    min_top1_agreement: float = 0.98
    """Share of samples whose int8 top-1 class equals the fp32 one."""
    max_abs_diff: float | None = None
    """Largest |int8 - fp32| over every output value; None does not check it."""
    max_accuracy_drop: float = 0.01
    """With labels: fp32 top-1 accuracy minus int8 top-1 accuracy."""
    min_cosine: float = 0.99
    """For models whose output is a vector (embedders): the least cosine similarity between a
    sample's int8 and fp32 vectors."""
    measure: str = "top1"
    """How agreement is judged: "top1" (classifiers) or "cosine" (embedders)."""


@dataclass(frozen=True)
class ValidationSamples:
    """Inputs plus labels and/or the fp32 model's outputs (`validation.npz` in an archive,
    named by the manifest's `scriptserve.validationSamples`).

    The file's arrays, all with the same rows: one per model input, named by the input;
    optional `labels` (one int class per row); optional `output.<name>` (the fp32 model's
    outputs; without them the fp32 model is run)."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    expected: dict[str, np.ndarray] | None = None

    @property
    def rows(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    def save(self, path: Path) -> Path:
        arrays = dict(self.inputs)
        arrays.update({f"output.{k}": v for k, v in (self.expected or {}).items()})
        if self.labels is not None:
            arrays["labels"] = self.labels
        with path.open("wb") as fh:
            np.savez_compressed(fh, **arrays)  # type: ignore[arg-type]
        return path

    @classmethod
    def load(cls, path: Path) -> ValidationSamples:
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise QuantizationError(f"validation file {path.name!r} is not a .npz: {exc}") from None
        expected = {k[7:]: v for k, v in arrays.items() if k.startswith("output.")}
        inputs = {
            k.removeprefix("input."): v
            for k, v in arrays.items()
            if k != "labels" and not k.startswith("output.")
        }
        rows = {a.shape[0] if a.ndim else 0 for a in (*inputs.values(), *expected.values())}
        labels = arrays.get("labels")
        if labels is not None:
            rows.add(labels.shape[0] if labels.ndim == 1 else -1)
        if not inputs or len(rows) != 1 or 0 in rows or -1 in rows:
            raise QuantizationError(
                f"validation file {path.name!r} must hold one array per model input, optional "
                "labels (one int per row) and output.<name> arrays, all with the same rows (dim 0)"
            )
        return cls(inputs, labels, expected or None)


@dataclass(frozen=True)
class ValidationResult:
    samples: int
    max_abs_diff: float
    top1_agreement: float | None = None
    fp32_accuracy: float | None = None
    int8_accuracy: float | None = None
    min_cosine: float | None = None
    """The least cosine similarity between a sample's int8 and fp32 output rows."""


def max_abs_diff(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    diffs = [
        float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)), initial=0.0))
        for k in a
        if k in b and np.issubdtype(a[k].dtype, np.number)
    ]
    return max(diffs, default=0.0)


def compare(
    fp32: Runner, int8: Runner, samples: ValidationSamples, chunk: int = 64
) -> ValidationResult:
    ref: dict[str, list[np.ndarray]] = {}
    got: dict[str, list[np.ndarray]] = {}
    for start in range(0, samples.rows, chunk):
        part = {k: v[start : start + chunk] for k, v in samples.inputs.items()}
        for k, v in int8(part).items():
            got.setdefault(k, []).append(v)
        if samples.expected is None:
            for k, v in fp32(part).items():
                ref.setdefault(k, []).append(v)
    int8_out = {k: np.concatenate(v) for k, v in got.items()}
    if samples.expected is not None:
        ref_out = dict(samples.expected)
        if set(ref_out) != set(int8_out) and len(ref_out) == len(int8_out):
            ref_out = dict(zip(int8_out, ref_out.values(), strict=True))
    else:
        ref_out = {k: np.concatenate(v) for k, v in ref.items()}
    result = ValidationResult(samples.rows, max_abs_diff(ref_out, int8_out))
    first = next(iter(int8_out))
    a, b = ref_out.get(first), int8_out[first]
    if a is not None and a.ndim >= 2 and a.shape == b.shape:
        result = replace(result, min_cosine=_least_cosine(a, b))
    if a is not None and a.ndim == 2 and a.shape[1] > 1:
        top_ref, top_int8 = a.argmax(1), b.argmax(1)
        result = replace(result, top1_agreement=float(np.mean(top_ref == top_int8)))
        if samples.labels is not None:
            labels = samples.labels.astype(np.int64)
            result = replace(
                result,
                fp32_accuracy=float(np.mean(top_ref == labels)),
                int8_accuracy=float(np.mean(top_int8 == labels)),
            )
    return result


def _least_cosine(a: np.ndarray, b: np.ndarray) -> float:
    rows_a = a.reshape(a.shape[0], -1).astype(np.float64)
    rows_b = b.reshape(b.shape[0], -1).astype(np.float64)
    norms = np.linalg.norm(rows_a, axis=1) * np.linalg.norm(rows_b, axis=1)
    cosines = (rows_a * rows_b).sum(axis=1) / np.maximum(norms, 1e-30)
    return float(cosines.min())


def check_tolerance(result: ValidationResult, tolerance: Tolerance, what: str = "int8") -> None:
    """Raise QuantizationError naming the measure that is over its tolerance; `what` names the
    converted model in the message."""
    n = result.samples
    fix = "loosen the tolerance only if that is acceptable, or serve the fp32 model"
    cosine = result.min_cosine
    if tolerance.measure == "cosine" and cosine is not None and cosine < tolerance.min_cosine:
        raise QuantizationError(
            f"{what} refused: the cosine similarity of its output with fp32's falls to "
            f"{cosine:.4f} on one of {n} validation samples, below the minimum "
            f"{tolerance.min_cosine} (min cosine); {fix}"
        )
    agreement = result.top1_agreement if tolerance.measure == "top1" else None
    if agreement is not None and agreement < tolerance.min_top1_agreement:
        raise QuantizationError(
            f"{what} refused: its top-1 class agrees with fp32 on {agreement:.2%} of {n} "
            f"validation samples, below the minimum {tolerance.min_top1_agreement:.2%} "
            f"(min top-1 agreement); {fix}"
        )
    if tolerance.max_abs_diff is not None and result.max_abs_diff > tolerance.max_abs_diff:
        raise QuantizationError(
            f"{what} refused: max |{what} - fp32| on {n} validation samples is "
            f"{result.max_abs_diff:.4g}, over the tolerance {tolerance.max_abs_diff:g} "
            f"(max abs diff); {fix}"
        )
    if result.fp32_accuracy is not None and result.int8_accuracy is not None:
        drop = result.fp32_accuracy - result.int8_accuracy
        if drop > tolerance.max_accuracy_drop:
            raise QuantizationError(
                f"{what} refused: top-1 accuracy falls from {result.fp32_accuracy:.2%} (fp32) to "
                f"{result.int8_accuracy:.2%} on {n} labelled samples, more than the allowed "
                f"drop of {tolerance.max_accuracy_drop:.2%} (max accuracy drop); {fix}"
            )
