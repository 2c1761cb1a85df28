"""Writing an archive from model-archiver's arguments: check the model loads and runs its
sample, record its signature, pack it with its handler and files.

The model is one of:
- an AOTInductor package (`.pt2`), packed as it is once it ran the sample here;
- an eager model compiled into one (`--export-pt2`: `--model-file` with its state dict as
  `--serialized-file`), or an ExportedProgram saved with torch.export.save (a `.pt2` without
  compiled code), compiled without the flag (archiver/pt2_export.py);
- a TorchScript or ONNX file, converted to dynamic int8 first with `--quantize`.
"""

from __future__ import annotations

import argparse
import glob
import json
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from scriptserve.archiver.archive import (
    ArchiveError,
    ArchiveFormat,
    ArchiveSpec,
    build_archive,
    collect_files,
)
from scriptserve.archiver.fp32_reference import check_fp32_archive_flag, fp32_from_archive
from scriptserve.archiver.manifest import (
    Manifest,
    ModelFormat,
    ModelInfo,
    Pt2Info,
    Quantization,
    ScriptserveInfo,
    check_model_name,
    format_for_file,
)
from scriptserve.archiver.model_file import probe_model
from scriptserve.archiver.precision import check_precision, precision_problem
from scriptserve.archiver.pt2_check import check_package
from scriptserve.archiver.pt2_export import (
    DEFAULT_MAX_BATCH,
    Pt2Source,
    build_package,
    is_pt2_source,
    max_batch_from,
    sequence_inputs,
)
from scriptserve.archiver.pt2_package import int8_isa
from scriptserve.archiver.quantize import (
    STATIC_INT8,
    QuantizationError,
    QuantizeOptions,
    Tolerance,
    ValidationSamples,
    converter_for,
    is_torchscript_file,
    quantize_model_file,
    quantize_pt2,
)
from scriptserve.handlers.runtime.signature import (
    Signature,
    SignatureError,
    arrays_from_json,
    numpy_dtype,
)

Report = Callable[[str], None]
"""Where a measurement line goes (model-archiver prints it to stderr)."""

# Built-in handler names: ours, and TorchServe's (served by the TorchServe compatibility layer).
BUILTIN_HANDLERS = (
    "tensor",
    "base_handler",
    "image_classifier",
    "text_generator",
    "text_classifier",
    "text_embedder",
    "object_detector",
    "image_segmenter",
)


def _extra_files(spec: str) -> list[Path]:
    paths: list[Path] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matches:
            raise ArchiveError(f"--extra-files: nothing matches {item!r}")
        paths.extend(Path(m) for m in matches)
    return paths


def _shape_sample(shapes: list[str], datatype: str | None) -> dict[str, np.ndarray]:
    sample = {}
    rng = np.random.default_rng(0)
    for i, item in enumerate(shapes):
        name, _, dims = item.rpartition("=")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            raise SignatureError(f"--input-shape {item!r}: use comma-separated integers") from None
        array = rng.standard_normal((1, *shape)).astype(numpy_dtype(datatype or "FP32"))
        sample[name or f"input{i}"] = array
    return sample


def _load_sample(args: argparse.Namespace, fmt: ModelFormat) -> dict[str, np.ndarray] | None:
    if args.sample_input is not None:
        try:
            data = json.loads(args.sample_input.read_text())
        except json.JSONDecodeError as exc:
            raise SignatureError(f"--sample-input is not valid JSON: {exc}") from None
        # ONNX records its own input types; TorchScript and pt2 inputs take --input-dtype.
        known = probe_model(args.serialized_file, fmt) if fmt == "onnx" else Signature()
        return arrays_from_json(data, known, default_datatype=args.input_dtype)
    if args.input_shape:
        sample = _shape_sample(args.input_shape, args.input_dtype)
        if fmt == "onnx":  # unnamed shapes take the graph's input names, in its order
            names = [t.name for t in probe_model(args.serialized_file, fmt).inputs]
            unnamed = all(name == f"input{i}" for i, name in enumerate(sample))
            if unnamed and len(names) == len(sample):
                sample = dict(zip(names, sample.values(), strict=True))
        return sample
    return None


def _generated_sample(args: argparse.Namespace, signature: Signature, workdir: Path) -> Path:
    """The sample an archive made with --input-shape keeps, so that its workers warm up: the
    inputs the archiver ran, named by the signature, as `/predictions` JSON."""
    arrays = list(_shape_sample(args.input_shape, args.input_dtype).values())
    names = [t.name for t in signature.inputs]
    if len(names) != len(arrays):
        names = [f"input{i}" for i in range(len(arrays))]
    rows = [np.round(a[0], 4).tolist() for a in arrays]
    document: Any = rows[0] if len(rows) == 1 else dict(zip(names, rows, strict=True))
    path = workdir / "sample.json"
    path.write_text(json.dumps(document))
    return path


def _read_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    if not path.is_file():
        raise ArchiveError(f"config file not found: {path}")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ArchiveError(f"--config-file is not valid YAML: {exc}") from None
    if config is not None and not isinstance(config, dict):
        raise ArchiveError("--config-file must hold a YAML mapping")
    return config or {}


def _quantize(
    args: argparse.Namespace,
    fmt: ModelFormat,
    sample: dict[str, np.ndarray] | None,
    validation: ValidationSamples | None,
    workdir: Path,
    report: Report,
) -> tuple[Path, Quantization]:
    """Convert --serialized-file to dynamic int8 in `workdir`; print what it measured."""
    src: Path = args.serialized_file
    if sample is None:
        raise QuantizationError(
            "--quantize needs --sample-input, --input-shape or --validation-file to measure the "
            "int8 model against fp32"
        )
    eager = fmt == "torchscript" and args.model_file is not None and not is_torchscript_file(src)
    options = QuantizeOptions(
        weight_type=args.weight_type,
        per_channel=args.per_channel,
        reduce_range=args.reduce_range,
        model_file=args.model_file if eager else None,
        model_class=args.model_class,
    )
    tolerance = _tolerance(args)
    dst = workdir / f"{src.stem}.int8{'.onnx' if fmt == 'onnx' else '.pt'}"
    measured = quantize_model_file(src, dst, fmt, sample, options, validation, tolerance)
    report(measured.summary())
    return dst, measured.manifest_entry("archive")


EMBEDDING_HANDLERS = ("text_embedder",)
"""Handlers whose model answers with vectors: the accuracy guard compares them by cosine."""


def _tolerance(args: argparse.Namespace) -> Tolerance:
    return Tolerance(
        min_top1_agreement=args.min_top1_agreement,
        max_abs_diff=args.max_abs_diff,
        max_accuracy_drop=args.max_accuracy_drop,
        min_cosine=args.min_cosine,
        measure="cosine" if args.handler in EMBEDDING_HANDLERS else "top1",
    )


def _pt2_source(args: argparse.Namespace) -> Pt2Source:
    """The model a package is compiled from: an ExportedProgram, or an eager class and its
    state dict."""
    exported_program = is_pt2_source(args.serialized_file)
    if not exported_program and args.model_file is None:
        raise ArchiveError(
            "--export-pt2 needs the model's class: --model-file (and --model-class when the "
            "file defines several) with its state dict as --serialized-file"
        )
    return Pt2Source(
        weights=args.serialized_file,
        model_file=None if exported_program else args.model_file,
        model_class=args.model_class,
    )


def _quantize_pt2(
    args: argparse.Namespace,
    fp32: Path,
    info: Pt2Info,
    sample: dict[str, np.ndarray],
    validation: ValidationSamples | None,
    workdir: Path,
    report: Report,
) -> tuple[Path, Quantization, Pt2Info]:
    """Compile the int8 package of the model `fp32` was compiled from; print what it measured."""
    dst = workdir / f"{args.model_name}.int8.pt2"
    tolerance = _tolerance(args)
    max_batch = info.max_batch or DEFAULT_MAX_BATCH
    measured = quantize_pt2(
        _pt2_source(args),
        fp32,
        dst,
        sample,
        max_batch,
        args.quantize,
        QuantizeOptions(reduce_range=args.reduce_range),
        validation,
        tolerance,
        max_seq_len=info.max_seq_len,
    )
    isa = int8_isa()
    report(f"{measured.summary()}; int8 kernels ({isa}): {', '.join(measured.quantized_ops)}")
    checked = check_package(dst, sample, None, info.source, exported_bound=info.max_batch)
    compiled = measured.options.get("compileOptions", {})
    built = replace(checked.info, compile_options=compiled, max_seq_len=info.max_seq_len)
    entry = measured.manifest_entry("archive")
    return dst, replace(entry, details={**entry.details, "isa": isa}), built


def _pt2_model(
    args: argparse.Namespace,
    sample: dict[str, np.ndarray] | None,
    config: dict[str, Any],
    workdir: Path,
    report: Report,
) -> tuple[Path, Signature, Pt2Info]:
    """The package to pack: the user's, checked, or one compiled here from the model."""
    src: Path = args.serialized_file
    flag: int | None = getattr(args, "max_batch", None)
    exported_program = is_pt2_source(src)
    if not (getattr(args, "export_pt2", False) or exported_program):
        if getattr(args, "quantize", "none") != "none":
            raise QuantizationError(
                "--quantize on a .pt2 needs the model it is compiled from: --export-pt2 with "
                "--model-file and its state dict, or an ExportedProgram saved with "
                "torch.export.save; a compiled package cannot be quantized"
            )
        build = check_package(src, sample, flag)
        return build.package, build.signature, build.info
    source = _pt2_source(args)
    if sample is None:
        raise ArchiveError("compiling a .pt2 package needs --sample-input or --input-shape")
    dst = workdir / f"{args.model_name}.pt2"
    device = getattr(args, "pt2_device", "cpu")
    # An ExportedProgram keeps its own dynamic shapes: only the flag may lower its bound.
    max_batch = flag if exported_program else max_batch_from(flag, config)
    max_seq_len: int | None = getattr(args, "max_seq_len", None)
    precision: str = getattr(args, "precision", "fp32")
    reference: Path | None = getattr(args, "fp32_archive", None)
    if reference is not None:  # an int8 package's fp32 reference, compiled already
        build = fp32_from_archive(reference, source, sample, flag, max_seq_len, workdir)
    else:
        build = build_package(
            source, sample, max_batch, dst, device, max_seq_len, precision=precision
        )
    report(build.report)
    return build.package, build.signature, build.info


def _check_precision(
    args: argparse.Namespace,
    package: Path,
    info: Pt2Info,
    sample: dict[str, np.ndarray],
    validation: ValidationSamples | None,
    report: Report,
) -> Pt2Info:
    """Hold a bf16/fp16 package to the accuracy guard against the fp32 model; what it measured
    goes into the manifest."""
    samples = validation or ValidationSamples(dict(sample))
    checked = check_precision(
        package, _pt2_source(args), samples, _tolerance(args), info.target.device
    )
    result = checked["validation"]
    agreement = result.get("top1_agreement")
    cosine = result.get("min_cosine")
    report(
        f"{info.precision}: on {result['samples']} samples, max |{info.precision} - fp32| "
        f"{result['max_abs_diff']:.4g}"
        + (f", top-1 agreement {agreement:.2%}" if agreement is not None else "")
        + (f", least cosine {cosine:.4f}" if cosine is not None else "")
        + f" ({checked['isa']})"
    )
    return replace(info, precision_check=checked)


def create_archive(args: argparse.Namespace, report: Report) -> Path:
    """Check the model loads (and runs its sample), record its signature, write the archive;
    what a conversion or compilation measured goes to `report`."""
    with tempfile.TemporaryDirectory(prefix="scriptserve-archive-") as workdir:
        return _create_archive(args, Path(workdir), report)


def _model_format(args: argparse.Namespace) -> ModelFormat:
    if getattr(args, "export_pt2", False) or is_pt2_source(args.serialized_file):
        return "pt2"
    return format_for_file(args.serialized_file.name)


def _check_precision_flags(args: argparse.Namespace, quantize: bool) -> None:
    """Refuse a --precision this machine or these flags cannot take, before compiling."""
    precision: str = getattr(args, "precision", "fp32")
    if precision == "fp32":
        return
    if quantize:
        raise ArchiveError(
            f"--precision {precision} and --quantize each make the package; choose one"
        )
    problem = precision_problem(precision, getattr(args, "pt2_device", "cpu"))
    if problem is not None:
        raise ArchiveError(problem)


def _check_quantize(
    args: argparse.Namespace, fmt: ModelFormat, validation: ValidationSamples | None
) -> None:
    """Refuse a --quantize this model cannot take, before anything is converted or compiled."""
    if fmt != "pt2":
        if args.quantize == STATIC_INT8:
            raise QuantizationError(
                f"static-int8 is made for .pt2 packages (torchao's PT2E flow); {fmt} models "
                "take dynamic-int8"
            )
        converter_for(fmt)
        return
    if getattr(args, "pt2_device", "cpu") != "cpu":
        raise QuantizationError(
            "int8 .pt2 packages run on the CPU (torchao's X86 Inductor quantizer); compile "
            "fp32 for CUDA"
        )
    if args.quantize == STATIC_INT8 and validation is None:
        raise QuantizationError(
            "static-int8 calibrates activation ranges on validation samples: give "
            "--validation-file (or use dynamic-int8)"
        )


def _model(
    args: argparse.Namespace,
    fmt: ModelFormat,
    config: dict[str, Any],
    validation: ValidationSamples | None,
    workdir: Path,
    report: Report,
) -> tuple[Path, Signature, Quantization, Pt2Info | None]:
    """The model file to pack (compiled or converted to int8 as asked), its signature, how it
    was quantized and, for a `.pt2`, how it was compiled."""
    quantize = getattr(args, "quantize", "none") != "none"
    check_fp32_archive_flag(getattr(args, "fp32_archive", None), quantize and fmt == "pt2")
    if quantize:
        _check_quantize(args, fmt, validation)
    eager_source = (
        quantize
        and fmt == "torchscript"
        and args.model_file is not None
        and not is_torchscript_file(args.serialized_file)
    )
    sample = None if eager_source else _load_sample(args, fmt)
    if sample is None and validation is not None:
        sample = {k: v[:1] for k, v in validation.inputs.items()}
    model: Path = args.serialized_file
    quantization = Quantization()
    if fmt == "pt2":
        _check_precision_flags(args, quantize)
        model, signature, pt2 = _pt2_model(args, sample, config, workdir, report)
        if pt2.precision != "fp32":
            assert sample is not None  # _pt2_model compiled with it
            pt2 = _check_precision(args, model, pt2, sample, validation, report)
        if quantize:
            assert sample is not None  # _pt2_model compiled with it
            model, quantization, pt2 = _quantize_pt2(
                args, model, pt2, sample, validation, workdir, report
            )
        return model, signature, quantization, pt2
    if quantize:
        if eager_source and (args.sample_input is not None or args.input_shape):
            sample = _load_sample(args, fmt)
        elif not eager_source:
            probe_model(model, fmt, sample)  # the fp32 model must load and run first
        model, quantization = _quantize(args, fmt, sample, validation, workdir, report)
    signature = probe_model(model, fmt, sample)
    if fmt == "torchscript" and getattr(args, "max_seq_len", None) and sample is not None:
        # A TorchScript model takes any length its code allows: the flag says which dimension.
        signature = signature.with_dynamic_dim(1, sequence_inputs(sample))
    return model, signature, quantization, None


def _create_archive(args: argparse.Namespace, workdir: Path, report: Report) -> Path:
    name = check_model_name(args.model_name)
    if not args.serialized_file.is_file():
        raise ArchiveError(f"--serialized-file not found: {args.serialized_file}")
    fmt = _model_format(args)
    config = _read_config(args.config_file)
    validation_file: Path | None = getattr(args, "validation_file", None)
    validation = ValidationSamples.load(validation_file) if validation_file else None
    model, signature, quantization, pt2 = _model(args, fmt, config, validation, workdir, report)

    files: dict[str, Path] = {model.name: model}
    if validation_file is not None:
        files[validation_file.name] = validation_file
    handler = args.handler
    if handler not in BUILTIN_HANDLERS:
        handler_path = Path(handler.partition(":")[0])
        if handler_path.suffix != ".py":
            handler_path = handler_path.with_suffix(".py")
        if not handler_path.is_file():
            raise ArchiveError(
                f"--handler {handler!r} is neither a built-in ({', '.join(BUILTIN_HANDLERS)}) "
                "nor an existing .py file"
            )
        files[handler_path.name] = handler_path
        entry = handler.partition(":")[2]
        handler = handler_path.name + (f":{entry}" if entry else "")
    sample_file: Path | None = args.sample_input
    if sample_file is None and args.input_shape:
        sample_file = _generated_sample(args, signature, workdir)
    optional = {
        "model": args.model_file,
        "requirements": args.requirements_file,
        "config": args.config_file,
        "sample": sample_file,
    }
    for what, path in optional.items():
        if path is not None:
            if not path.is_file():
                raise ArchiveError(f"{what} file not found: {path}")
            files[path.name] = path
    for path in _extra_files(args.extra_files):
        for arcname, src in collect_files([path]).items():
            if arcname in files and files[arcname].resolve() != src.resolve():
                raise ArchiveError(f"two files would both be stored as {arcname!r}; rename one")
            files[arcname] = src

    manifest = Manifest(
        model=ModelInfo(
            model_name=name,
            model_version=args.version,
            handler=handler,
            serialized_file=model.name,
            model_file=args.model_file.name if args.model_file else None,
            requirements_file=args.requirements_file.name if args.requirements_file else None,
            config_file=args.config_file.name if args.config_file else None,
        ),
        runtime=args.runtime,
        scriptserve=ScriptserveInfo(
            model_format=fmt,
            files={},
            signature=signature,
            quantization=quantization,
            sample_input=sample_file.name if sample_file else None,
            validation_samples=validation_file.name if validation_file else None,
            pt2=pt2,
            max_seq_len=getattr(args, "max_seq_len", None)
            if fmt in ("torchscript", "onnx")
            else None,
        ),
    )
    fmt_enum = ArchiveFormat(args.archive_format)
    return build_archive(ArchiveSpec(manifest, files), args.export_path, fmt_enum, args.force)
