"""The fp32 package an int8 `.pt2` is measured against, taken from an archive of the same model
instead of compiled again (`model-archiver --quantize ... --fp32-archive model.mar`).

Archiving a model in fp32 and then in int8 compiles its fp32 package twice: once for the fp32
archive, and again as the reference that the int8 package's accuracy guard and speed are
measured against (as long as the int8 compile itself on a small model). `--fp32-archive` takes
the first one. The archive must hold a `.pt2` package made by model-archiver for the CPU by
this torch release, in fp32 and without --quantize, and its package must answer the sample as
the model given to this run does: a package of another model, or of other weights, is refused,
never measured against.

    build = fp32_from_archive(Path("resnet50.mar"), source, sample, None, None, workdir)
    build.package, build.info.max_batch  # its package, copied into workdir; its batch bound
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from scriptserve.archiver.archive import ArchiveError, open_archive
from scriptserve.archiver.manifest import Manifest, Pt2Info
from scriptserve.archiver.model_source import load_eager_model, load_exported_program
from scriptserve.archiver.pt2_check import Pt2Build, check_package, model_outputs
from scriptserve.archiver.pt2_export import Pt2Source, bind_sample

SAME_MODEL = 1e-3
"""The largest |package - model| on the sample, relative to the model's largest output value,
of a package compiled from the model (a compile's own differences are about 1e-6)."""


def check_fp32_archive_flag(archive: Path | None, int8_pt2: bool) -> None:
    """Refuse --fp32-archive where no int8 `.pt2` package is made."""
    if archive is not None and not int8_pt2:
        raise ArchiveError(
            "--fp32-archive is the fp32 reference of an int8 .pt2 package: give it with "
            "--export-pt2 and --quantize"
        )


def fp32_from_archive(
    archive: Path,
    source: Pt2Source,
    sample: Mapping[str, np.ndarray],
    max_batch: int | None,
    max_seq_len: int | None,
    workdir: Path,
) -> Pt2Build:
    """The fp32 package of `archive`, copied into `workdir` and checked against `source` on
    `sample`: what the manifest says of it (its batch and sequence bounds, which the int8
    package is compiled for too), its signature, and a line for the user. ArchiveError says
    why an archive cannot serve (and what to give instead)."""
    with open_archive(archive) as reader:
        manifest = reader.manifest
        info = _usable(archive.name, manifest)
        for flag, asked, compiled in (
            ("--max-batch", max_batch, info.max_batch),
            ("--max-seq-len", max_seq_len, info.max_seq_len),
        ):
            if asked is not None and asked != compiled:
                raise ArchiveError(
                    f"{flag} {asked}, but --fp32-archive {archive.name} was compiled for "
                    f"{compiled}: give the same bound, or none"
                )
        package = workdir / "fp32-reference.pt2"
        shutil.copyfile(reader.path(manifest.model.serialized_file or ""), package)
    signature = manifest.signature
    named = bind_sample(sample, [spec.name for spec in signature.inputs], archive.name)
    reference = _model_output(source, named)
    build = check_package(
        package,
        named,
        None,
        info.source,
        info.compile_options,
        reference,
        exported_bound=info.max_batch,
    )
    scale = max([1.0, *(float(np.max(np.abs(r))) for r in reference if r.size)])
    diff = build.max_abs_diff or 0.0
    if diff > SAME_MODEL * scale:
        raise ArchiveError(
            f"--fp32-archive {archive.name} was not compiled from this model: its answer to the "
            f"sample differs from the model's by up to {diff:.3g}; give the archive made from "
            "these weights, or leave the flag out to compile the fp32 package here"
        )
    report = (
        f"pt2: the fp32 package of {archive.name} (batch 1 to {info.max_batch}), "
        f"max |pt2 - {info.source}| {diff:.3g}"
    )
    return replace(build, info=info, signature=signature, report=report)


def _usable(name: str, manifest: Manifest) -> Pt2Info:
    """The archive's `.pt2` description, when its package can be the fp32 reference."""
    import torch

    described = manifest.scriptserve
    info = None if described is None else described.pt2
    if described is None or info is None:
        raise ArchiveError(
            f"--fp32-archive {name} holds no .pt2 package: give an archive made with "
            "--export-pt2 (or of an ExportedProgram)"
        )
    refused = None
    if described.quantization.quantized:
        refused = f"is {described.quantization.mode}"
    elif info.precision != "fp32":
        refused = f"computes in {info.precision}"
    elif info.target.device != "cpu":
        refused = f"is compiled for {info.target.device}"
    elif info.torch_version != torch.__version__:
        refused = f"was compiled by torch {info.torch_version}, this is torch {torch.__version__}"
    if refused is not None:
        raise ArchiveError(
            f"--fp32-archive {name} {refused}: give the fp32 CPU archive made by this torch "
            "release, or leave the flag out to compile the fp32 package here"
        )
    return info


def _model_output(source: Pt2Source, named: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs on `named`, as the compile checks its package against."""
    if source.model_file is not None:
        model = load_eager_model(source.model_file, source.weights, source.model_class)
    else:
        model = load_exported_program(source.weights).module()
    return model_outputs(model, named)
