"""`model-archiver` (TorchServe's flags) and `scriptserve archive create|inspect|verify`.

Exit codes: 0 success, 2 usage error (argparse), 1 failure with a one-line reason.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from scriptserve import __version__
from scriptserve.archiver.archive import (
    ArchiveError,
    ArchiveFormat,
    iter_archive_files,
    open_archive,
    verify_archive,
)
from scriptserve.archiver.create import BUILTIN_HANDLERS, create_archive
from scriptserve.archiver.extract import UnsafeArchiveError
from scriptserve.archiver.manifest import Manifest, ManifestError
from scriptserve.archiver.model_file import ModelFileError
from scriptserve.archiver.pt2_export import DEFAULT_MAX_BATCH
from scriptserve.archiver.pt2_package import Pt2PackageError, compatibility_problem
from scriptserve.archiver.quantize import ARCHIVE_MODES, QuantizationError, Tolerance
from scriptserve.handlers.runtime.signature import SignatureError

USER_ERRORS = (
    ArchiveError,
    ManifestError,
    ModelFileError,
    SignatureError,
    UnsafeArchiveError,
    QuantizationError,
    Pt2PackageError,
    OSError,
)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


_crash_report: TextIO | None = None


def report_crashes() -> None:
    """A crash in native code (a compiled model, a GPU runtime) prints every thread's Python
    stack to stderr as it was when the command started: around calls into a compiled model the
    runtime's own messages are dropped from stderr (fd 2 points elsewhere), the crash report
    is not."""
    global _crash_report  # noqa: PLW0603 - one report file per process
    if _crash_report is None:
        _crash_report = os.fdopen(os.dup(2), "w")
        faulthandler.enable(file=_crash_report, all_threads=True)


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
        help="AOTInductor package (.pt2), TorchScript (.pt) or ONNX (.onnx) model file; with "
        "--export-pt2, the state dict of the --model-file model",
    )
    parser.add_argument(
        "--handler",
        default="tensor",
        help=f"built-in handler ({', '.join(BUILTIN_HANDLERS)}) or a handler .py file",
    )
    parser.add_argument(
        "--model-file",
        type=Path,
        help="Python file with the model class (exported with --export-pt2, else kept for "
        "reference)",
    )
    parser.add_argument(
        "--model-class", help="nn.Module class in --model-file, when it defines several"
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
        "--input-dtype",
        default=None,
        help="OIP datatype of TorchScript and .pt2 inputs (default: INT64 for a sample input "
        "written as JSON integers, such as token ids, else FP32)",
    )
    add_pt2_arguments(parser)
    add_quantize_arguments(parser)


def add_pt2_arguments(parser: argparse.ArgumentParser) -> None:
    """Making a .pt2 package with torch.export and AOTInductor (archiver/pt2_export.py)."""
    group = parser.add_argument_group("pt2 (torch.export + AOTInductor)")
    group.add_argument(
        "--export-pt2",
        action="store_true",
        help="export the --model-file model, with its state dict as --serialized-file, and "
        "compile it into a .pt2 package (an ExportedProgram .pt2 is compiled without this flag)",
    )
    group.add_argument(
        "--max-batch",
        type=int,
        help="largest batch (rows) the exported package takes (default: the config file's "
        f"batchSize, else {DEFAULT_MAX_BATCH}); for a user's package, at most its own bound",
    )
    group.add_argument(
        "--max-seq-len",
        type=int,
        help="longest sequence the exported package takes: dim 1 of the inputs shaped [batch, "
        "seq] becomes dynamic from 1 to this (default: a Hugging Face model's "
        "max_position_embeddings when the sample holds token ids; else fixed at the sample's); "
        "for TorchScript and ONNX, recorded for the text handlers to truncate to",
    )
    group.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="what the compiled model computes in, its inputs and outputs staying float32: bf16 "
        "on CPUs with AVX512-BF16 or AMX and on GPUs, fp16 on GPUs; held to the accuracy guard "
        "against fp32 on the validation samples (default fp32)",
    )
    group.add_argument(
        "--pt2-device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="device to compile the package for (cuda needs a GPU on this machine)",
    )


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """--quantize, its options and the accuracy guard's tolerances (docs/quantization.md)."""
    group = parser.add_argument_group("quantization")
    group.add_argument(
        "--quantize",
        default="none",
        choices=ARCHIVE_MODES,
        help="store the model converted to int8 (needs a sample input or validation file); "
        "static-int8 (activation ranges calibrated on --validation-file) is for .pt2 packages",
    )
    group.add_argument(
        "--validation-file",
        type=Path,
        help=".npz of validation samples (one array per input, labels, output.<name>); "
        "stored in the archive and used by the accuracy guard",
    )
    group.add_argument(
        "--fp32-archive",
        type=Path,
        help="with --export-pt2: an archive of this same model made without --quantize, whose "
        "compiled package the int8 one is measured against instead of one compiled here "
        "(checked against the model on the sample)",
    )
    group.add_argument(
        "--weight-type", default="qint8", choices=["qint8", "quint8"], help="ONNX weight type"
    )
    group.add_argument("--per-channel", action="store_true", help="per-channel weight scales")
    group.add_argument(
        "--reduce-range",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="7-bit activations (.pt2) or weights (ONNX), which keep int8 accurate on x86 CPUs "
        "without VNNI (default: on where the archiving CPU lacks VNNI)",
    )

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
        "--min-cosine",
        type=float,
        default=defaults.min_cosine,
        help="guard, for embedders (--handler text_embedder): least cosine similarity of an "
        "int8 output vector with fp32's (default %(default)s)",
    )
    group.add_argument(
        "--max-accuracy-drop",
        type=float,
        default=defaults.max_accuracy_drop,
        help="guard, with labels: largest fp32 - int8 top-1 accuracy (default %(default)s)",
    )


def inspect_archive(path: Path, as_json: bool) -> str:
    with open_archive(path, verify=False) as reader:
        files = list(iter_archive_files(reader))
        parsed = reader.manifest
        manifest = parsed.to_dict()
        fmt = reader.format.value
    if as_json:
        listing = [{"name": n, "size": s, "sha256": h} for n, s, h in files]
        document = {"archive": str(path), "format": fmt, "manifest": manifest, "files": listing}
        return json.dumps(document, indent=2)
    lines = [f"archive: {path} ({fmt})", *_pt2_summary(parsed), *_quantization_summary(parsed)]
    lines += ["manifest:", json.dumps(manifest, indent=2), "files:"]
    width = max(len(name) for name, _, _ in files)
    lines += [f"  {name:<{width}}  {size:>12}  {digest}" for name, size, digest in files]
    return "\n".join(lines)


def _pt2_summary(manifest: Manifest) -> list[str]:
    """What a .pt2 archive was compiled for, and whether this machine can serve it (on CPU, or
    on the GPU the package was compiled for)."""
    info = manifest.scriptserve.pt2 if manifest.scriptserve else None
    if info is None:
        return []
    target = info.target
    where = target.isa or target.cuda_arch or ""
    device = "cuda:0" if target.device == "cuda" else "cpu"
    problem = compatibility_problem(info, device)
    return [
        f"pt2: torch {info.torch_version}, {target.device} {where}, batch 1 to "
        f"{info.max_batch or 'any'} ({info.source})",
        f"this machine: {'can serve it' if problem is None else 'cannot serve it: ' + problem}",
    ]


def _quantization_summary(manifest: Manifest) -> list[str]:
    """How an int8 archive was quantized, measured, and which int8 kernels it runs."""
    quantization = manifest.scriptserve.quantization if manifest.scriptserve else None
    if quantization is None or not quantization.quantized:
        return []
    ops = quantization.details.get("quantizedOps") or {}
    kernels = ", ".join(f"{name} x{count}" for name, count in ops.items())
    return [
        f"int8: {quantization.mode}, {quantization.size_ratio}x smaller, "
        f"{quantization.latency_ratio}x faster than fp32 on the sample; runs {kernels or '?'}"
    ]


def verify(path: Path) -> tuple[bool, str]:
    report = verify_archive(path)
    return report.ok, report.reason()


def run_archive_command(args: argparse.Namespace, prog: str) -> int:
    """Dispatch `scriptserve archive …` after parsing."""
    try:
        if args.archive_command == "create":
            print(create_archive(args, _to_stderr))
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
    if argv is None:  # the command itself, not a call from Python
        report_crashes()
    parser = argparse.ArgumentParser(
        prog="model-archiver",
        description="Pack a .pt2 (AOTInductor), TorchScript or ONNX model, its handler and "
        "files into one archive.",
    )
    add_create_arguments(parser)
    parser.add_argument("--archiver-version", action="version", version=__version__)
    args = parser.parse_args(argv)
    try:
        print(create_archive(args, _to_stderr))
    except USER_ERRORS as exc:
        fail("model-archiver", str(exc))
    return 0
