"""`.pt2` archives: made by model-archiver from an eager model and its state dict, from an
ExportedProgram, or from a user's own package; what the manifest records; inspect, verify and
predict; the one-line errors."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from pt2models import TINY_MAX_BATCH, inductor_cache, tiny_archive, tiny_package
from testmodels import TinyMLP, reference_output
from torch.export import Dim

from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.manifest import Manifest, Pt2Info
from scriptserve.archiver.model_file import ModelFileError
from scriptserve.archiver.model_source import load_exported_program
from scriptserve.archiver.pt2_export import DEFAULT_MAX_BATCH, max_batch_from

# Slow: the tiny model compiled to .pt2 (about 10 s on 2 cores), and model-archiver's CLI in a
# process per test.
pytestmark = pytest.mark.slow


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=300, check=False)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """Exit 1 with exactly one `model-archiver: error: ...` line and no traceback."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("model-archiver: error: ")
    return lines[0].removeprefix("model-archiver: error: ")


def manifest_of(archive: Path) -> Manifest:
    with open_archive(archive) as reader:
        return reader.manifest


def pt2_of(manifest: Manifest) -> Pt2Info:
    assert manifest.scriptserve is not None and manifest.scriptserve.pt2 is not None
    return manifest.scriptserve.pt2


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pt2_sample") / "sample.json"
    path.write_text(json.dumps([0.5] * 8))
    return path


def archive_package(package: Path, sample: Path, store: Path, *extra: str) -> Path:
    argv = [
        "--model-name", "user", "--version", "1.0", "--serialized-file", str(package),
        "--sample-input", str(sample), "--export-path", str(store), *extra,
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return store / "user.mar"


def test_an_eager_model_and_its_state_dict_become_a_compiled_archive() -> None:
    manifest = manifest_of(tiny_archive())

    assert manifest.model_format == "pt2"
    assert manifest.model.serialized_file == "tiny_pt2.pt2"
    assert manifest.model.model_file == "testmodels.py"
    assert manifest.scriptserve is not None
    assert sorted(manifest.scriptserve.files) == ["sample.json", "testmodels.py", "tiny_pt2.pt2"]
    assert manifest.scriptserve.sample_input == "sample.json"
    assert manifest.signature.to_dict() == {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
        "outputs": [{"name": "output0", "datatype": "FP32", "shape": [-1, 3]}],
    }
    info = pt2_of(manifest)
    assert (info.torch_version, info.max_batch, info.source) == (
        torch.__version__,
        TINY_MAX_BATCH,
        "eager",
    )
    assert info.target.device == "cpu"
    assert info.target.isa  # e.g. "AVX512 AVX512_VNNI", as Inductor picked it
    assert {"freezing": True, "noGrad": True}.items() <= info.compile_options.items()
    if info.target.isa.startswith("AVX512"):
        # A portable level, not -march=native: it runs on any AVX-512 CPU.
        assert info.target.march == info.compile_options["cpp.march"] == "x86-64-v4"
        assert {"avx512_f", "avx512_bw", "avx512_dq", "avx512_vl"} <= set(info.target.cpu_flags)


def test_a_users_package_is_packed_as_it_is(sample: Path, tmp_path: Path) -> None:
    package = tiny_package()

    archive = archive_package(package, sample, tmp_path)

    manifest = manifest_of(archive)
    info = pt2_of(manifest)
    assert manifest.model_format == "pt2"
    assert manifest.scriptserve is not None
    digest = hashlib.sha256(package.read_bytes()).hexdigest()
    assert manifest.scriptserve.files["tiny.pt2"] == digest
    # Read from the package itself: the exported bound and the compiler's flags.
    assert info.source == "package"
    assert info.max_batch == TINY_MAX_BATCH
    assert info.target == pt2_of(manifest_of(tiny_archive())).target
    assert manifest.signature.inputs[0].shape == (-1, 8)


def test_max_batch_may_lower_a_packages_bound_but_not_raise_it(
    sample: Path, tmp_path: Path
) -> None:
    lower = archive_package(tiny_package(), sample, tmp_path / "a", "--max-batch", "16")
    assert pt2_of(manifest_of(lower)).max_batch == 16

    done = run(
        "model-archiver",
        "--model-name",
        "user",
        "--version",
        "1.0",
        "--serialized-file",
        str(tiny_package()),
        "--sample-input",
        str(sample),
        "--export-path",
        str(tmp_path / "b"),
        "--max-batch",
        str(TINY_MAX_BATCH + 1),
    )

    assert one_line_error(done) == (
        f"--max-batch {TINY_MAX_BATCH + 1} is more than the {TINY_MAX_BATCH} rows tiny.pt2 was "
        "exported for"
    )


def test_an_exported_program_is_compiled(sample: Path, tmp_path: Path) -> None:
    program = torch.export.export(
        TinyMLP().eval(),
        (torch.zeros(2, 8),),
        dynamic_shapes=({0: Dim("batch", min=1, max=TINY_MAX_BATCH)},),
    )
    torch.export.save(program, tmp_path / "tiny_ep.pt2")

    with inductor_cache():
        archive = archive_package(tmp_path / "tiny_ep.pt2", sample, tmp_path / "store")

    manifest = manifest_of(archive)
    info = pt2_of(manifest)
    assert (info.source, info.max_batch) == ("exported-program", TINY_MAX_BATCH)
    assert manifest.model.serialized_file == "user.pt2"
    assert manifest.signature.inputs[0].name == "x"
    with open_archive(archive) as reader, zipfile.ZipFile(reader.root / "user.pt2") as zf:
        assert any(n.endswith(".so") for n in zf.namelist())  # compiled, not the program


def test_an_exported_program_that_needs_pickle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pickled.pt2"
    config = {"config": {"w": {"path_name": "weight_0", "use_pickle": True}}}
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pickled/models/model.json", "{}")
        zf.writestr("pickled/data/weights/model_weights_config.json", json.dumps(config))

    with pytest.raises(ModelFileError, match="'w' is stored with pickle"):
        load_exported_program(path)


@pytest.mark.parametrize(
    ("flag", "config", "expected"),
    [(8, {"batchSize": 32}, 8), (None, {"batchSize": 32}, 32), (None, {}, DEFAULT_MAX_BATCH)],
)
def test_the_exported_batch_bound_comes_from_the_flag_then_the_config(
    flag: int | None, config: dict[str, int], expected: int
) -> None:
    assert max_batch_from(flag, config) == expected


def test_export_pt2_without_the_model_class_is_a_one_line_error(
    sample: Path, tmp_path: Path
) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(TinyMLP().state_dict(), weights)

    done = run(
        "model-archiver",
        "--model-name",
        "m",
        "--version",
        "1.0",
        "--export-pt2",
        "--serialized-file",
        str(weights),
        "--sample-input",
        str(sample),
        "--export-path",
        str(tmp_path),
    )

    assert "--export-pt2 needs the model's class: --model-file" in one_line_error(done)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a zip at all", "junk.pt2 is not a .pt2 file (a zip archive)"),
        (None, "junk.pt2 is not an AOTInductor package with a model"),
    ],
)
def test_a_pt2_file_that_is_no_package_is_a_one_line_error(
    sample: Path, tmp_path: Path, content: bytes | None, message: str
) -> None:
    junk = tmp_path / "junk.pt2"
    if content is None:
        with zipfile.ZipFile(junk, "w") as zf:
            zf.writestr("junk/archive_format", "pt2")
    else:
        junk.write_bytes(content)

    done = run(
        "model-archiver",
        "--model-name",
        "m",
        "--version",
        "1.0",
        "--serialized-file",
        str(junk),
        "--sample-input",
        str(sample),
        "--export-path",
        str(tmp_path),
    )

    assert one_line_error(done).startswith(message)


def test_a_sample_of_the_wrong_width_is_a_one_line_error(tmp_path: Path) -> None:
    short = tmp_path / "short.json"
    short.write_text(json.dumps([0.5] * 5))

    done = run(
        "model-archiver",
        "--model-name",
        "m",
        "--version",
        "1.0",
        "--serialized-file",
        str(tiny_package()),
        "--sample-input",
        str(short),
        "--export-path",
        str(tmp_path),
    )

    assert one_line_error(done) == (
        "tiny.pt2 failed on the sample input: the compiled model failed to run: "
        "input_handles[0]: unmatched dim value at 1, expected: 8, but got: 5"
    )


def test_inspect_verify_and_predict(tmp_path: Path) -> None:
    archive = tiny_archive()
    body = tmp_path / "input.json"
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    body.write_text(json.dumps(x.tolist()))

    inspected = run("scriptserve", "archive", "inspect", str(archive))
    verified = run("scriptserve", "archive", "verify", str(archive))
    predicted = run("scriptserve", "predict", str(archive), "--input", str(body))

    assert inspected.returncode == 0, inspected.stderr
    info = pt2_of(manifest_of(archive))
    assert (
        f"pt2: torch {torch.__version__}, cpu {info.target.isa}, batch 1 to {TINY_MAX_BATCH} "
        "(eager)"
    ) in inspected.stdout.splitlines()
    assert "this machine: can serve it" in inspected.stdout.splitlines()
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.strip() == f"{archive}: OK (all files match their SHA-256)"
    assert predicted.returncode == 0, predicted.stderr
    expected = reference_output(x[None])[0]
    np.testing.assert_allclose(json.loads(predicted.stdout), expected, atol=1e-4)
