"""int8 `.pt2` archives through torchao's PT2E flow: the kernels they run, what the manifest
records, the accuracy guard, the refusals, and the check that catches a package whose int8
weights are dequantized to fp32 on every call (pytorch/ao#4566)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from pt2models import (
    TINY_MAX_BATCH,
    inductor_cache,
    tiny_archive,
    tiny_int8_archive,
    tiny_package,
    tiny_validation,
)
from serving import run_command
from testmodels import TinyMLP, reference_output
from torch import nn

from scriptserve.archiver.accuracy import QuantizationError, ValidationSamples
from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.int8 import pt2 as pt2_int8
from scriptserve.archiver.manifest import Manifest
from scriptserve.archiver.pt2_check import PackageRunner
from scriptserve.archiver.pt2_export import compile_package, export_model
from scriptserve.archiver.pt2_package import lacks_vnni
from scriptserve.archiver.quantize import quantize_pt2, sha256_of

# Slow: int8 packages compiled through torchao's PT2E flow (10 to 20 s each).
pytestmark = pytest.mark.slow

INT8_LINEAR = "aoti_torch_cpu__qlinear_pointwise_tensor"
"""The fused oneDNN int8 linear of a dynamically quantized package."""


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """A console script (`model-archiver`, `scriptserve`) run as its own process."""
    return run_command(argv[0], *argv[1:], timeout_s=300)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0].removeprefix("model-archiver: error: ")


def manifest_of(archive: Path) -> Manifest:
    with open_archive(archive) as reader:
        return reader.manifest


def package_runner(archive: Path, workdir: Path) -> PackageRunner:
    """The archive's compiled package, run in this process."""
    manifest = manifest_of(archive)
    with open_archive(archive) as reader:
        name = manifest.model.serialized_file or ""
        target = workdir / name
        target.write_bytes((reader.root / name).read_bytes())
    return PackageRunner(target)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("int8_sample") / "sample.json"
    path.write_text(json.dumps([0.5] * 8))
    return path


def test_a_dynamic_int8_archive_runs_fused_int8_kernels_and_says_so() -> None:
    manifest = manifest_of(tiny_int8_archive("dynamic-int8"))

    info = manifest.scriptserve
    assert info is not None and info.pt2 is not None
    q = info.quantization
    assert manifest.model.serialized_file == "tiny_dynamic_int8.int8.pt2"
    assert manifest.model_format == "pt2"
    assert q.mode == "dynamic-int8"
    assert q.details["quantizedOps"] == {INT8_LINEAR: 2}  # TinyMLP's two Linear layers
    assert q.details["engine"] == "onednn"
    assert q.details["options"]["flow"] == "pt2e"
    assert q.details["options"]["scheme"] == "dynamic"
    assert q.details["options"]["reduceRange"] is lacks_vnni()
    assert q.details["options"]["quantizer"] == "X86InductorQuantizer"
    assert info.pt2.compile_options["freezing"] is True
    assert info.pt2.compile_options["noGrad"] is True
    assert info.pt2.max_batch == TINY_MAX_BATCH
    validation = q.details["validation"]
    assert validation["samples"] == 256
    assert validation["top1_agreement"] >= 0.98
    assert q.max_abs_diff is not None and q.max_abs_diff < 0.02


def test_int8_outputs_follow_fp32_on_every_kind_of_input(tmp_path: Path) -> None:
    runner = package_runner(tiny_int8_archive("dynamic-int8"), tmp_path)
    x = np.load(tiny_validation())["x"]
    positive = np.full((3, 8), 0.5, np.float32)

    for rows in (x[:TINY_MAX_BATCH], x[-TINY_MAX_BATCH:], positive, x[:1]):
        (out,) = runner({"x": rows}).values()
        # Before archiver/int8/pt2.py widened each dynamic range to include zero, the
        # all-positive rows were off by 0.14.
        np.testing.assert_allclose(out, reference_output(rows), atol=0.02)
    runner.close()


def test_static_int8_calibrates_on_the_validation_samples() -> None:
    manifest = manifest_of(tiny_int8_archive("static-int8"))

    q = manifest.scriptserve.quantization  # type: ignore[union-attr]
    assert q.mode == "static-int8"
    assert q.details["options"]["scheme"] == "static"
    kernels = q.details["quantizedOps"]
    assert kernels and all(k.startswith("aoti_torch_cpu__qlinear_pointwise") for k in kernels)
    assert q.details["validation"]["top1_agreement"] >= 0.98


def test_inspect_shows_how_it_was_quantized() -> None:
    archive = tiny_int8_archive("dynamic-int8")

    inspected = run("scriptserve", "archive", "inspect", str(archive))

    assert inspected.returncode == 0, inspected.stderr
    line = next(x for x in inspected.stdout.splitlines() if x.startswith("int8: "))
    assert line.startswith("int8: dynamic-int8, ")
    assert line.endswith(f"runs {INT8_LINEAR} x2")


def test_predict_serves_the_int8_archive(tmp_path: Path) -> None:
    body = tmp_path / "input.json"
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    body.write_text(json.dumps(x.tolist()))

    archive = tiny_int8_archive("dynamic-int8")
    predicted = run("scriptserve", "predict", str(archive), "--input", str(body))

    assert predicted.returncode == 0, predicted.stderr
    np.testing.assert_allclose(
        json.loads(predicted.stdout), reference_output(x[None])[0], atol=0.02
    )


def test_a_compiled_package_cannot_be_quantized(sample: Path, tmp_path: Path) -> None:
    done = run(
        "model-archiver",
        "--model-name",
        "m",
        "--version",
        "1.0",
        "--serialized-file",
        str(tiny_package()),
        "--sample-input",
        str(sample),
        "--export-path",
        str(tmp_path),
        "--quantize",
        "dynamic-int8",
    )

    assert one_line_error(done) == (
        "--quantize on a .pt2 needs the model it is compiled from: --export-pt2 with "
        "--model-file and its state dict, or an ExportedProgram saved with torch.export.save; "
        "a compiled package cannot be quantized"
    )


def eager_argv(tmp_path: Path, sample: Path, *extra: str) -> list[str]:
    weights = tmp_path / "weights.pt"
    torch.save(TinyMLP().state_dict(), weights)
    tests = Path(__file__).resolve().parents[1]
    return [
        "model-archiver",
        "--model-name",
        "m",
        "--version",
        "1.0",
        "--export-pt2",
        "--model-file",
        str(tests / "testmodels.py"),
        "--model-class",
        "TinyMLP",
        "--serialized-file",
        str(weights),
        "--sample-input",
        str(sample),
        "--export-path",
        str(tmp_path),
        *extra,
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--quantize", "static-int8"),
            "static-int8 calibrates activation ranges on validation samples: give "
            "--validation-file (or use dynamic-int8)",
        ),
        (
            ("--quantize", "dynamic-int8", "--pt2-device", "cuda"),
            "int8 .pt2 packages run on the CPU (torchao's X86 Inductor quantizer); compile "
            "fp32 for CUDA",
        ),
    ],
)
def test_what_int8_cannot_do_is_refused_before_compiling(
    extra: tuple[str, ...], message: str, sample: Path, tmp_path: Path
) -> None:
    done = run(*eager_argv(tmp_path, sample, *extra))

    assert one_line_error(done) == message


def test_an_int8_archive_is_measured_against_the_fp32_archive_it_names() -> None:
    """The tiny int8 archives are made with `--fp32-archive` (tests/pt2models.py): the fp32
    model they were measured against is the fp32 archive's package, byte for byte."""
    for mode in ("dynamic-int8", "static-int8"):
        q = manifest_of(tiny_int8_archive(mode)).scriptserve.quantization  # type: ignore[union-attr]
        assert q.source_sha256 == sha256_of(tiny_package())
        assert q.details["validation"]["top1_agreement"] >= 0.98


def other_weights(tmp_path: Path) -> Path:
    """TinyMLP's state dict with every weight changed: the same model, not the same weights."""
    model = TinyMLP()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1.5)
    path = tmp_path / "other.pt"
    torch.save(model.state_dict(), path)
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--fp32-archive", "{tiny}"),
            "--fp32-archive is the fp32 reference of an int8 .pt2 package: give it with "
            "--export-pt2 and --quantize",
        ),
        (
            ("--quantize", "dynamic-int8", "--fp32-archive", "{int8}"),
            "--fp32-archive tiny_static_int8.mar is static-int8: give the fp32 CPU archive made "
            "by this torch release, or leave the flag out to compile the fp32 package here",
        ),
        (
            ("--quantize", "dynamic-int8", "--max-batch", "8", "--fp32-archive", "{tiny}"),
            f"--max-batch 8, but --fp32-archive tiny_pt2.mar was compiled for {TINY_MAX_BATCH}: "
            "give the same bound, or none",
        ),
        (
            ("--quantize", "dynamic-int8", "--serialized-file", "{other}"),
            "--fp32-archive tiny_pt2.mar was not compiled from this model: its answer to the "
            "sample differs from the model's by up to ",
        ),
    ],
    ids=["without-quantize", "an-int8-archive", "another-bound", "other-weights"],
)
def test_an_fp32_archive_that_is_not_this_models_is_refused_before_compiling(
    extra: tuple[str, ...], message: str, sample: Path, tmp_path: Path
) -> None:
    given = {
        "tiny": str(tiny_archive()),
        "int8": str(tiny_int8_archive("static-int8")),
        "other": str(other_weights(tmp_path)),
    }
    extra = tuple(arg.format(**given) for arg in extra)
    if "--serialized-file" in extra:
        extra += ("--fp32-archive", given["tiny"])

    done = run(*eager_argv(tmp_path, sample, *extra))

    assert one_line_error(done).startswith(message)
    assert not list(tmp_path.glob("*.mar"))


def test_static_int8_is_for_pt2_only(sample: Path, tmp_path: Path) -> None:
    scripted = tmp_path / "tiny.pt"
    torch.jit.script(TinyMLP().eval()).save(str(scripted))  # type: ignore[no-untyped-call]

    done = run(
        "model-archiver",
        "--model-name",
        "m",
        "--version",
        "1.0",
        "--serialized-file",
        str(scripted),
        "--sample-input",
        str(sample),
        "--export-path",
        str(tmp_path),
        "--quantize",
        "static-int8",
    )

    assert one_line_error(done) == (
        "static-int8 is made for .pt2 packages (torchao's PT2E flow); torchscript models take "
        "dynamic-int8"
    )


class NoLayers(nn.Module):
    """Element-wise only: nothing for the PT2E quantizer to convert."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2 + 1


def test_a_model_with_nothing_to_quantize_is_refused_before_compiling(tmp_path: Path) -> None:
    """The quantizer finds nothing, and quantize_pt2 says so before any int8 compile (and
    before it would load the fp32 package to measure against)."""
    sample = {"x": np.full((1, 8), 0.5, np.float32)}
    program = export_model(NoLayers(), sample, 4)
    dst = tmp_path / "int8.pt2"

    with pytest.raises(QuantizationError) as refused:
        quantize_pt2(program, tmp_path / "fp32-never-read.pt2", dst, sample, 4)

    assert str(refused.value) == (
        "nothing to quantize: PT2E int8 converts Linear and Conv layers (torchao's "
        "X86InductorQuantizer), and this model has none (its ops: aten.add.Tensor, "
        "aten.mul.Tensor, aten.tanh.default); serve it in fp32 without --quantize"
    )
    assert not dst.exists()


def test_a_package_compiled_without_freezing_is_refused(tmp_path: Path) -> None:
    """The int8 program compiled as Inductor does by default: the weights stay int8 but are
    dequantized to fp32 before every matrix multiply, which the kernel check names."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    sample = {"x": np.full((2, 8), 0.5, np.float32)}
    program = export_model(TinyMLP(), sample, TINY_MAX_BATCH)
    quantizer = X86InductorQuantizer()
    quantizer.set_global(get_default_x86_inductor_quantization_config(is_dynamic=True))
    prepared = prepare_pt2e(program.module(), quantizer)
    prepared(torch.from_numpy(sample["x"]))
    converted = convert_pt2e(prepared)
    with inductor_cache():
        package = compile_package(
            export_model(converted, sample, TINY_MAX_BATCH), tmp_path / "unfrozen.pt2", {}
        )

    with pytest.raises(QuantizationError) as refused:
        pt2_int8.check_kernels(package)

    message = str(refused.value)
    assert message.startswith(
        "the compiled int8 package runs no int8 kernels: it dequantizes its int8 weights to "
        "fp32 on every call (cpp_fused_"
    )
    assert "pytorch/ao#4566" in message
    assert pt2_int8.check_kernels(tiny_archive_int8_package(tmp_path)) == {INT8_LINEAR: 2}


def tiny_archive_int8_package(tmp_path: Path) -> Path:
    archive = tiny_int8_archive("dynamic-int8")
    with open_archive(archive) as reader:
        target = tmp_path / "frozen.pt2"
        target.write_bytes((reader.root / "tiny_dynamic_int8.int8.pt2").read_bytes())
    return target


class GreyNet(nn.Module):
    """LeNet's shape in small: a convolution of one input channel (grey images) first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.grey = nn.Conv2d(1, 4, 3)
        self.conv = nn.Conv2d(4, 8, 3)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(torch.relu(self.grey(x))))
        return self.head(h.flatten(1))


def test_static_int8_leaves_one_channel_convolutions_fp32_and_follows_fp32(
    tmp_path: Path,
) -> None:
    # Inductor's int8 convolution of a one-channel input answers wrongly once the batch is
    # dynamic (LeNet on digits: 153 of 200 classified differently); the layer stays fp32.
    model = GreyNet().eval()
    rng = np.random.default_rng(0)
    images = rng.random((96, 1, 8, 8), dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(images)).numpy()
    program = export_model(model, {"x": images[:2]}, 16)
    validation = ValidationSamples({"x": images})

    with inductor_cache():
        done = pt2_int8.convert(
            program,
            {"x": images[:2]},
            tmp_path / "grey.pt2",
            16,
            static=True,
            validation=validation,
            reduce_range=lacks_vnni(),
        )

    assert done.options["leftFloat"] == ["grey"]
    assert done.quantized_layers == 2  # the second convolution and the linear head
    assert any("qconv" in kernel for kernel in done.kernels), done.kernels
    runner = PackageRunner(done.package)
    for start, stop in ((0, 16), (16, 21), (0, 1)):
        (out,) = runner({"x": images[start:stop]}).values()
        reference = expected[start:stop]
        assert (out.argmax(1) == reference.argmax(1)).mean() >= 0.8
        np.testing.assert_allclose(out, reference, atol=0.1)
    runner.close()
