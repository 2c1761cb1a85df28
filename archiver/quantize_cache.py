"""Dynamic int8 at load time: an archive's model converted once and cached on disk.

`quantize: dynamic-int8` in a model config (or a registration's `quantize` parameter) asks for
it; `quantize_for_load` returns the int8 file to serve and the manifest recording it. Entries
are keyed by the source model's SHA-256 and the options, so a restart reuses them, and server
replicas that share one cache directory convert each entry once: a file lock per entry (it
holds across processes) guards the conversion, and files are written whole through a temporary
name and `os.replace`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock, Timeout

from scriptserve.archiver.accuracy import (
    QuantizationError,
    Tolerance,
    ValidationSamples,
    check_tolerance,
)
from scriptserve.archiver.manifest import Manifest, ModelFormat
from scriptserve.archiver.quantize import (
    MODES,
    QuantizationReport,
    QuantizeOptions,
    convert,
    converter_for,
    sha256_of,
)

log = logging.getLogger("scriptserve.quantize")


@dataclass(frozen=True)
class LoadRequest:
    """`quantize: dynamic-int8` from a model config or a registration, with its tolerances."""

    options: QuantizeOptions = field(default_factory=QuantizeOptions)
    tolerance: Tolerance = field(default_factory=Tolerance)


_CONFIG_KEYS = {
    "quantizeMinTop1Agreement": "min_top1_agreement",
    "quantizeMaxAbsDiff": "max_abs_diff",
    "quantizeMaxAccuracyDrop": "max_accuracy_drop",
}


def load_request(
    config: Mapping[str, Any], requested: str | None = None, threads: int = 1
) -> LoadRequest | None:
    """What the model config (`quantize`, `quantize*` keys) and a registration's `quantize`
    parameter (which wins) ask for; None for fp32. `threads`: the server's per-worker count."""
    mode = requested if requested else config.get("quantize", "none")
    mode = "none" if mode in (None, False) else str(mode)
    if mode not in MODES:
        raise QuantizationError(
            f"quantize {mode!r} is not supported; use one of {', '.join(MODES)}"
        )
    if mode == "none":
        return None
    try:
        limits: dict[str, Any] = {
            v: float(config[k]) for k, v in _CONFIG_KEYS.items() if config.get(k) is not None
        }
        tolerance = Tolerance(**limits)
        options = QuantizeOptions(
            weight_type=str(config.get("quantizeWeightType", "qint8")),
            per_channel=bool(config.get("quantizePerChannel", False)),
            reduce_range=_optional_bool(config.get("quantizeReduceRange")),
            threads=threads,
        )
    except (TypeError, ValueError) as exc:
        raise QuantizationError(f"invalid quantize setting in the model config: {exc}") from None
    return LoadRequest(options, tolerance)


def _optional_bool(value: Any) -> bool | None:
    """A config flag that is left to the machine when unset."""
    if value is None or isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"{value!r} is not true or false")


def archive_samples(
    root: Path, manifest: Manifest
) -> tuple[dict[str, np.ndarray] | None, ValidationSamples | None]:
    """The archive's sample input and validation samples, where it has them."""
    from scriptserve.handlers.runtime.signature import SignatureError, arrays_from_json

    info = manifest.scriptserve
    validation = None
    if info is not None and info.validation_samples:
        validation = ValidationSamples.load(root / info.validation_samples)
    sample = None
    if info is not None and info.sample_input:
        try:
            data = json.loads((root / info.sample_input).read_text())
            sample = arrays_from_json(data, manifest.signature)
        except (OSError, json.JSONDecodeError, SignatureError) as exc:
            raise QuantizationError(f"the archive's sample input does not load: {exc}") from None
    if sample is None and validation is not None:
        sample = {k: v[:1] for k, v in validation.inputs.items()}
    if sample is None:
        sample = _signature_sample(manifest)
    return sample, validation


def _signature_sample(manifest: Manifest) -> dict[str, np.ndarray] | None:
    """One seeded random row per input, when the recorded signature fixes every other dim."""
    from scriptserve.handlers.runtime.signature import numpy_dtype

    inputs = manifest.signature.inputs
    if not inputs or any(d < 0 for t in inputs for d in t.shape[1:]):
        return None
    rng = np.random.default_rng(0)
    return {
        t.name: rng.standard_normal((1, *t.shape[1:])).astype(numpy_dtype(t.datatype))
        for t in inputs
    }


def quantize_cached(
    src: Path,
    fmt: ModelFormat,
    cache_dir: Path,
    sample_inputs: Mapping[str, np.ndarray],
    request: LoadRequest,
    validation: ValidationSamples | None = None,
    validation_sha256: str = "",
) -> tuple[Path, QuantizationReport]:
    """The int8 file for `src` from `cache_dir`, converting (and caching) it on first use.

    Cache entries are `<sha256 of src>-<options digest>.{pt,onnx,json}`; a restart reuses them.
    Server replicas may share `cache_dir`: one of them converts an entry while the others wait
    for it, then reuse it. The accuracy guard is applied to the (cached or fresh) validation
    result."""
    converter = converter_for(fmt)
    source_sha = sha256_of(src)
    key_data = {**request.options.key(), "validation": validation_sha256, **converter.versions()}
    digest = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:12]
    key = f"{source_sha}-{digest}"
    model_path = cache_dir / f"{key}{converter.suffix}"
    report_path = cache_dir / f"{key}.json"
    # Entries are only ever written whole (os.replace), so a finished one is read without the
    # lock: replicas starting on a warm cache never touch it.
    report = _cached_report(model_path, report_path, warn=False)
    if report is None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _entry_lock(cache_dir / f"{key}.lock", src.name):
            # Another replica's entry, when it converted while this one waited for the lock.
            report = _cached_report(model_path, report_path, warn=True)
            if report is None:
                report = _convert_entry(
                    src=src,
                    fmt=fmt,
                    model_path=model_path,
                    report_path=report_path,
                    sample=sample_inputs,
                    options=request.options,
                    validation=validation,
                )
    if report.cached:
        log.info("dynamic int8 of %s loaded from the cache (%s)", src.name, model_path.name)
    if report.validation is not None:
        check_tolerance(report.validation, request.tolerance)
    return model_path, report


@contextlib.contextmanager
def _entry_lock(path: Path, model: str) -> Iterator[None]:
    """One cache entry's lock, held across processes (a replica that dies releases it)."""
    lock = FileLock(path)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        log.info("waiting for another process converting %s to dynamic int8", model)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _convert_entry(
    *,
    src: Path,
    fmt: ModelFormat,
    model_path: Path,
    report_path: Path,
    sample: Mapping[str, np.ndarray],
    options: QuantizeOptions,
    validation: ValidationSamples | None,
) -> QuantizationReport:
    """Convert `src` and write the entry's model, then its report, each through a temporary
    file of its own, so that a reader never sees a half-written file."""
    tmp = _temporary(model_path)
    try:
        report = convert(src, tmp, fmt, sample, options, validation)
        os.replace(tmp, model_path)
        tmp = _temporary(report_path)
        tmp.write_text(json.dumps(report.to_dict(), indent=2))
        os.replace(tmp, report_path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("converted %s to dynamic int8, cached as %s", src.name, model_path.name)
    return report


def _temporary(path: Path) -> Path:
    """A new, empty file beside `path`, with its suffix, to write in full before `os.replace`."""
    fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=path.suffix, dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the entry from replicas of another user
    finally:
        os.close(fd)
    return Path(name)


def _cached_report(model_path: Path, report_path: Path, *, warn: bool) -> QuantizationReport | None:
    """The entry's report when its model file is the one the report describes, else None
    (`warn`: say why a present entry is not used)."""
    if not (model_path.is_file() and report_path.is_file()):
        return None
    try:
        report = QuantizationReport.from_dict(json.loads(report_path.read_text()))
        intact = report.int8_sha256 == sha256_of(model_path)
    except (OSError, ValueError, TypeError) as exc:
        if warn:
            log.warning("ignoring the unreadable cache entry %s: %s", report_path.name, exc)
        return None
    if not intact:
        if warn:
            log.warning("ignoring the cache entry %s: its model file changed", model_path.name)
        return None
    return replace(report, cached=True)


def quantize_for_load(
    root: Path, manifest: Manifest, cache_dir: Path, request: LoadRequest
) -> tuple[Path, Manifest]:
    """The model file to serve and the manifest recording its quantization.

    An archive that is already int8 is served as it is."""
    if manifest.scriptserve is not None and manifest.scriptserve.quantization.mode != "none":
        return root / (manifest.model.serialized_file or ""), manifest
    if not manifest.model.serialized_file:
        raise QuantizationError("the archive names no serialized model file to quantize")
    src = root / manifest.model.serialized_file
    sample, validation = archive_samples(root, manifest)
    if sample is None:
        raise QuantizationError(
            "quantizing at load needs the archive's sample input, validation samples or a "
            "signature with fixed shapes; rebuild it with --sample-input or --validation-file"
        )
    info = manifest.scriptserve
    validation_sha = (
        sha256_of(root / info.validation_samples)
        if info is not None and info.validation_samples
        else ""
    )
    path, report = quantize_cached(
        src, manifest.model_format, cache_dir, sample, request, validation, validation_sha
    )
    entry = report.manifest_entry("load")
    entry = replace(entry, details={**entry.details, "cached": report.cached})
    if info is not None:
        manifest = manifest.with_scriptserve(replace(info, quantization=entry))
    return path, manifest
