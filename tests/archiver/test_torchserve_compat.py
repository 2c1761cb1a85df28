"""Archives made by TorchServe's own `torch-model-archiver` open, run, and report unverifiable.

torch-model-archiver refuses a handler name it does not know (`--handler tensor` ends in a
FileNotFoundError for tensor.py), so the archives carry a one-line handler file subclassing ours.
Their manifest has no scriptserve section: the format comes from the serialized file's extension.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from testmodels import reference_output, save_onnx, save_torchscript

from scriptserve.archiver.archive import ArchiveFormat, detect_format, open_archive, verify_archive
from scriptserve.server.cli import predict

HANDLER = "from handlers.tensor import TensorHandler\n\n\nclass H(TensorHandler):\n    pass\n"
SAMPLE = [0.25 * i for i in range(8)]
EXPECTED = reference_output(np.asarray([SAMPLE], dtype=np.float32))[0]
SUFFIX = {"default": ".mar", "zip-store": ".mar", "tgz": ".tar.gz", "no-archive": ""}


def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    save_torchscript(src / "tiny.pt")
    save_onnx(src / "tiny.onnx")
    (src / "tensor_handler.py").write_text(HANDLER)
    (src / "sample.json").write_text(json.dumps(SAMPLE))
    return src


@pytest.fixture(scope="module")
def torchserve_archives(sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny.pt packed by torch-model-archiver in its four formats, under store/<format>/."""
    store = tmp_path_factory.mktemp("store")
    for fmt in SUFFIX:
        (store / fmt).mkdir()
        done = run(
            "torch-model-archiver",
            "--model-name",
            "tiny",
            "--version",
            "1.0",
            "--serialized-file",
            "tiny.pt",
            "--handler",
            "tensor_handler.py",
            "--extra-files",
            "sample.json",
            "--export-path",
            str(store / fmt),
            "--archive-format",
            fmt,
            cwd=sources,
        )
        assert done.returncode == 0, done.stderr
    return store


def test_torch_model_archiver_rejects_an_unknown_handler_name(
    sources: Path, tmp_path: Path
) -> None:
    # Why the archives here ship a handler file instead of `--handler tensor`.
    done = run(
        "torch-model-archiver",
        "--model-name",
        "t",
        "--version",
        "1.0",
        "--serialized-file",
        "tiny.pt",
        "--handler",
        "tensor",
        "--export-path",
        str(tmp_path),
        cwd=sources,
    )
    assert "tensor.py" in done.stderr
    assert not (tmp_path / "t.mar").exists()


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_torchserve_archive_opens_and_predicts(
    torchserve_archives: Path, sources: Path, fmt: str
) -> None:
    archive = torchserve_archives / fmt / f"tiny{SUFFIX[fmt]}"
    assert archive.exists()
    if fmt == "tgz":
        with tarfile.open(archive) as tf:
            assert all(n.startswith("tiny/") for n in tf.getnames())
    if fmt == "zip-store":
        with zipfile.ZipFile(archive) as zf:
            assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
    assert detect_format(archive) is ArchiveFormat(fmt)

    with open_archive(archive) as reader:
        manifest = reader.manifest
        assert manifest.scriptserve is None
        assert manifest.model_format == "torchscript"
        assert manifest.model.model_name == "tiny"
        assert manifest.model.model_version == "1.0"
        assert manifest.model.serialized_file == "tiny.pt"
        assert manifest.model.handler == "tensor_handler.py"
        assert manifest.signature.inputs == ()
        assert (reader.root / "sample.json").is_file()

    result = predict(archive, sources / "sample.json", "cpu")
    assert np.allclose(np.asarray(result), EXPECTED, atol=1e-5)


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_torchserve_archive_is_unverifiable(torchserve_archives: Path, fmt: str) -> None:
    archive = torchserve_archives / fmt / f"tiny{SUFFIX[fmt]}"
    report = verify_archive(archive)
    assert not report.ok
    assert report.unverifiable is not None
    assert "hashes" in report.reason()


def test_cli_verify_of_a_torchserve_archive_exits_1(torchserve_archives: Path) -> None:
    done = run("scriptserve", "archive", "verify", str(torchserve_archives / "default/tiny.mar"))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("scriptserve archive: error:")
    assert "verification failed" in line
    assert "hashes" in line
    assert "torch-model-archiver" in line


@pytest.mark.slow
def test_scriptserve_predict_runs_a_torchserve_archive(
    torchserve_archives: Path, sources: Path
) -> None:
    archive = torchserve_archives / "tgz" / "tiny.tar.gz"
    done = run("scriptserve", "predict", str(archive), "--input", str(sources / "sample.json"))
    assert done.returncode == 0, done.stderr
    assert np.allclose(np.asarray(json.loads(done.stdout)), EXPECTED, atol=1e-5)


def test_torchserve_onnx_archive_takes_its_format_from_the_extension(
    sources: Path, tmp_path: Path
) -> None:
    done = run(
        "torch-model-archiver",
        "--model-name",
        "tiny-onnx",
        "--version",
        "2.0",
        "--serialized-file",
        "tiny.onnx",
        "--handler",
        "tensor_handler.py",
        "--export-path",
        str(tmp_path),
        cwd=sources,
    )
    assert done.returncode == 0, done.stderr
    archive = tmp_path / "tiny-onnx.mar"
    with open_archive(archive) as reader:
        assert reader.manifest.scriptserve is None
        assert reader.manifest.model_format == "onnx"
    result = predict(archive, sources / "sample.json", "cpu")
    assert np.allclose(np.asarray(result), EXPECTED, atol=1e-5)
