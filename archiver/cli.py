"""`model-archiver` (TorchServe's flags) and `scriptserve archive create|inspect|verify`.

Exit codes: 0 success, 2 usage error (argparse), 1 failure with a one-line reason.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import yaml

from scriptserve import __version__
from scriptserve.archiver.archive import (
    ArchiveError,
    ArchiveFormat,
    ArchiveSpec,
    build_archive,
    collect_files,
    iter_archive_files,
    open_archive,
    verify_archive,
)
from scriptserve.archiver.extract import UnsafeArchiveError
from scriptserve.archiver.manifest import (
    Manifest,
    ManifestError,
    ModelInfo,
    Quantization,
    ScriptserveInfo,
    check_model_name,
    format_for_file,
)
from scriptserve.archiver.model_file import ModelFileError, probe_model
from scriptserve.archiver.quantize import (
    MODES,
    QuantizationError,
    QuantizeOptions,
    Tolerance,
    ValidationSamples,
    is_torchscript_file,
    quantize_model_file,
)
from scriptserve.archiver.signature import Signature, SignatureError, arrays_from_json, numpy_dtype

# Built-in handler names: ours, and TorchServe's (served by the TorchServe compatibility layer).
BUILTIN_HANDLERS = (
    "tensor",
    "base_handler",
    "image_classifier",
    "text_classifier",
    "object_detector",
    "image_segmenter",
)

USER_ERRORS = (
    ArchiveError,
    ManifestError,
    ModelFileError,
    SignatureError,
    UnsafeArchiveError,
    QuantizationError,
    OSError,
)


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(1)


class ModelVersionAction(argparse.Action):
    """`-v/--version VERSION` is the model's version (TorchServe's flag); given alone, without a
    value, it prints scriptserve's version and exits, as `--version` does for other commands."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if values is None:
            print(f"{parser.prog} {__version__}")
            parser.exit()
        setattr(namespace, self.dest, values)


def add_create_arguments(parser: argparse.ArgumentParser) -> None:
    """TorchServe's torch-model-archiver flags, plus the signature flags of scriptserve."""
    parser.add_argument(
        "--model-name", required=True, help="name of the model; the archive is <name>.mar"
    )
    parser.add_argument(
        "-v",
        "--version",
        required=True,
        nargs="?",
        action=ModelVersionAction,
        help="model version, e.g. 1.0 (alone, without a value: print scriptserve's version)",
    )
    parser.add_argument(
        "--serialized-file",
        required=True,
        type=Path,
        help="TorchScript (.pt) or ONNX (.onnx) model file",
    )
    parser.add_argument(
        "--handler",
        default="tensor",
        help=f"built-in handler ({', '.join(BUILTIN_HANDLERS)}) or a handler .py file",
    )
    parser.add_argument(
        "--model-file", type=Path, help="Python file with the model class (kept for reference)"
    )
    parser.add_argument(
        "--extra-files", default="", help="comma-separated files, directories or wildcards"
    )
    parser.add_argument("--runtime", default="python", choices=["python", "python3"])
    parser.add_argument("--export-path", type=Path, default=Path.cwd(), help="output directory")
    parser.add_argument(
        "--archive-format", default="default", choices=[f.value for f in ArchiveFormat]
    )
    parser.add_argument("-f", "--force", action="store_true", help="overwrite an existing archive")
    parser.add_argument(
        "-r", "--requirements-file", type=Path, help="model-specific pip requirements"
    )
    parser.add_argument("-c", "--config-file", type=Path, help="model config YAML")
    parser.add_argument(
        "--sample-input",
        type=Path,
        help="JSON sample: an array (one instance of the single input) or {name: instance}",
    )
    parser.add_argument(
        "--input-shape",
        action="append",
        default=[],
        help="per-instance input shape without the batch dim, e.g. 512 or x=3,32,32 (repeatable)",
    )
    parser.add_argument(
        "--input-dtype", default="FP32", help="OIP datatype of TorchScript inputs (default FP32)"
    )
    add_quantize_arguments(parser)


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """--quantize, its options and the accuracy guard's tolerances (docs/quantization.md)."""
    group = parser.add_argument_group("quantization")
    group.add_argument(
        "--quantize",
        default="none",
        choices=MODES,
        help="store the model converted to dynamic int8 (needs a sample input or validation file)",
    )
    group.add_argument(
        "--validation-file",
        type=Path,
        help=".npz of validation samples (one array per input, labels, output.<name>); "
        "stored in the archive and used by the accuracy guard",
    )
    group.add_argument(
        "--weight-type", default="qint8", choices=["qint8", "quint8"], help="ONNX weight type"
    )
    group.add_argument("--per-channel", action="store_true", help="per-channel weight scales")
    group.add_argument(
        "--reduce-range", action="store_true", help="ONNX: 7-bit weights, for CPUs without VNNI"
    )
    group.add_argument("--model-class", help="nn.Module class in --model-file (eager source)")
    defaults = Tolerance()
    group.add_argument(
        "--min-top1-agreement",
        type=float,
        default=defaults.min_top1_agreement,
        help="guard: least share of validation samples whose int8 top-1 class is fp32's "
        "(default %(default)s)",
    )
    group.add_argument(
        "--max-abs-diff",
        type=float,
        default=None,
        help="guard: largest |int8 - fp32| output value (default: not checked)",
    )
    group.add_argument(
        "--max-accuracy-drop",
        type=float,
        default=defaults.max_accuracy_drop,
        help="guard, with labels: largest fp32 - int8 top-1 accuracy (default %(default)s)",
    )


def _extra_files(spec: str) -> list[Path]:
    paths: list[Path] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matches:
            raise ArchiveError(f"--extra-files: nothing matches {item!r}")
        paths.extend(Path(m) for m in matches)
    return paths


def _shape_sample(shapes: list[str], datatype: str) -> dict[str, np.ndarray]:
    sample = {}
    rng = np.random.default_rng(0)
    for i, item in enumerate(shapes):
        name, _, dims = item.rpartition("=")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            raise SignatureError(f"--input-shape {item!r}: use comma-separated integers") from None
        array = rng.standard_normal((1, *shape)).astype(numpy_dtype(datatype))
        sample[name or f"input{i}"] = array
    return sample


def _load_sample(args: argparse.Namespace, fmt: Any) -> dict[str, np.ndarray] | None:
    if args.sample_input is not None:
        try:
            data = json.loads(args.sample_input.read_text())
        except json.JSONDecodeError as exc:
            raise SignatureError(f"--sample-input is not valid JSON: {exc}") from None
        # ONNX records its own input types; TorchScript inputs take --input-dtype.
        known = probe_model(args.serialized_file, fmt) if fmt == "onnx" else Signature()
        return arrays_from_json(data, known, default_datatype=args.input_dtype)
    if args.input_shape:
        return _shape_sample(args.input_shape, args.input_dtype)
    return None


def _quantize(
    args: argparse.Namespace,
    fmt: Any,
    sample: dict[str, np.ndarray] | None,
    validation: ValidationSamples | None,
    workdir: Path,
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
    tolerance = Tolerance(args.min_top1_agreement, args.max_abs_diff, args.max_accuracy_drop)
    dst = workdir / f"{src.stem}.int8{'.onnx' if fmt == 'onnx' else '.pt'}"
    report = quantize_model_file(src, dst, fmt, sample, options, validation, tolerance)
    print(report.summary(), file=sys.stderr)
    return dst, report.manifest_entry("archive")


def create_archive(args: argparse.Namespace) -> Path:
    """Check the model loads (and runs its sample), record its signature, write the archive."""
    with tempfile.TemporaryDirectory(prefix="scriptserve-archive-") as workdir:
        return _create_archive(args, Path(workdir))


def _create_archive(args: argparse.Namespace, workdir: Path) -> Path:
    name = check_model_name(args.model_name)
    if not args.serialized_file.is_file():
        raise ArchiveError(f"--serialized-file not found: {args.serialized_file}")
    fmt = format_for_file(args.serialized_file.name)
    quantize = getattr(args, "quantize", "none") != "none"
    validation_file: Path | None = getattr(args, "validation_file", None)
    validation = ValidationSamples.load(validation_file) if validation_file else None
    eager_source = (
        quantize
        and fmt == "torchscript"
        and args.model_file is not None
        and not is_torchscript_file(args.serialized_file)
    )
    sample = None if eager_source else _load_sample(args, fmt)
    if sample is None and validation is not None:
        sample = {k: v[:1] for k, v in validation.inputs.items()}
    model = args.serialized_file
    quantization = Quantization()
    if quantize:
        if eager_source and (args.sample_input is not None or args.input_shape):
            sample = _load_sample(args, fmt)
        elif not eager_source:
            probe_model(model, fmt, sample)  # the fp32 model must load and run first
        model, quantization = _quantize(args, fmt, sample, validation, workdir)
    signature = probe_model(model, fmt, sample)

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
    optional = {
        "model": args.model_file,
        "requirements": args.requirements_file,
        "config": args.config_file,
        "sample": args.sample_input,
    }
    for what, path in optional.items():
        if path is not None:
            if not path.is_file():
                raise ArchiveError(f"{what} file not found: {path}")
            files[path.name] = path
    if args.config_file is not None:
        try:
            config = yaml.safe_load(args.config_file.read_text())
        except yaml.YAMLError as exc:
            raise ArchiveError(f"--config-file is not valid YAML: {exc}") from None
        if config is not None and not isinstance(config, dict):
            raise ArchiveError("--config-file must hold a YAML mapping")
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
            sample_input=args.sample_input.name if args.sample_input else None,
            validation_samples=validation_file.name if validation_file else None,
        ),
    )
    fmt_enum = ArchiveFormat(args.archive_format)
    return build_archive(ArchiveSpec(manifest, files), args.export_path, fmt_enum, args.force)


def inspect_archive(path: Path, as_json: bool) -> str:
    with open_archive(path, verify=False) as reader:
        files = list(iter_archive_files(reader))
        manifest = reader.manifest.to_dict()
        fmt = reader.format.value
    if as_json:
        listing = [{"name": n, "size": s, "sha256": h} for n, s, h in files]
        document = {"archive": str(path), "format": fmt, "manifest": manifest, "files": listing}
        return json.dumps(document, indent=2)
    lines = [f"archive: {path} ({fmt})", "manifest:", json.dumps(manifest, indent=2), "files:"]
    width = max(len(name) for name, _, _ in files)
    lines += [f"  {name:<{width}}  {size:>12}  {digest}" for name, size, digest in files]
    return "\n".join(lines)


def verify(path: Path) -> tuple[bool, str]:
    report = verify_archive(path)
    return report.ok, report.reason()


def run_archive_command(args: argparse.Namespace, prog: str) -> int:
    """Dispatch `scriptserve archive …` after parsing."""
    try:
        if args.archive_command == "create":
            print(create_archive(args))
        elif args.archive_command == "inspect":
            print(inspect_archive(args.archive, args.json))
        else:
            ok, reason = verify(args.archive)
            if not ok:
                fail(prog, f"{args.archive}: verification failed: {reason}")
            print(f"{args.archive}: OK ({reason})")
    except USER_ERRORS as exc:
        fail(prog, str(exc))
    return 0


def add_archive_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="archive_command", required=True)
    add_create_arguments(sub.add_parser("create", help="write an archive (model-archiver's flags)"))
    p = sub.add_parser("inspect", help="print manifest, files, sizes and hashes")
    p.add_argument("archive", type=Path)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p = sub.add_parser("verify", help="recompute every hash; exit 1 naming what differs")
    p.add_argument("archive", type=Path)


def model_archiver_main(argv: Sequence[str] | None = None) -> int:
    """`model-archiver`: TorchServe's torch-model-archiver command line."""
    parser = argparse.ArgumentParser(
        prog="model-archiver",
        description="Pack a TorchScript or ONNX model, its handler and files into one archive.",
    )
    add_create_arguments(parser)
    parser.add_argument("--archiver-version", action="version", version=__version__)
    args = parser.parse_args(argv)
    try:
        print(create_archive(args))
    except USER_ERRORS as exc:
        fail("model-archiver", str(exc))
    return 0
