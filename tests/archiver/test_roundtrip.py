"""Build an archive in every format from real TorchScript and ONNX models, open it, run it."""

from __future__ import annotations

import hashlib
import json
import tarfile
import zipfile
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from conftest import ArchiveFactory
from testmodels import reference_output

from scriptserve.archiver.archive import (
    ArchiveError,
    ArchiveFormat,
    ArchiveSpec,
    build_archive,
    detect_format,
    open_archive,
)
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.manifest import CREATED_ON_FORMAT, MANIFEST_PATH, Manifest, ModelInfo
from scriptserve.server.cli import predict

FORMATS = ["default", "zip-store", "tgz", "no-archive"]
SAMPLE = np.full((1, 8), 0.5, dtype=np.float32)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(params=["torchscript", "onnx"])
def model(request: pytest.FixtureRequest) -> tuple[str, Path]:
    fixture = "torchscript_file" if request.param == "torchscript" else "onnx_file"
    return request.param, request.getfixturevalue(fixture)


@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_manifest_format_and_prediction(
    model: tuple[str, Path], fmt: str, make_archive: ArchiveFactory, sample_file: Path
) -> None:
    model_format, model_path = model
    archive = make_archive(model_path, fmt=fmt)
    assert archive.exists()

    with open_archive(archive) as reader:
        raw = json.loads((reader.root / MANIFEST_PATH).read_text())
        manifest = reader.manifest
        assert reader.format is ArchiveFormat(fmt)
        assert (reader.root / model_path.name).read_bytes() == model_path.read_bytes()

    # TorchServe's keys, spelled as torch-model-archiver writes them.
    assert raw["model"]["modelName"] == "tiny"
    assert raw["model"]["modelVersion"] == "1.0"
    assert raw["model"]["serializedFile"] == model_path.name
    assert raw["model"]["handler"] == "tensor"
    assert raw["runtime"] == "python"
    datetime.strptime(raw["createdOn"], CREATED_ON_FORMAT)  # raises if the format is wrong

    section = raw["scriptserve"]
    assert section["modelFormat"] == model_format
    assert manifest.model_format == model_format
    assert section["files"] == {
        model_path.name: sha256(model_path),
        "sample.json": sha256(sample_file),
    }
    assert section["sampleInput"] == "sample.json"

    (spec_in,) = manifest.signature.inputs
    (spec_out,) = manifest.signature.outputs
    assert spec_in.name == "x"
    assert (spec_in.datatype, spec_in.shape) == ("FP32", (-1, 8))
    assert spec_out.name == ("y" if model_format == "onnx" else "output0")
    assert (spec_out.datatype, spec_out.shape) == ("FP32", (-1, 3))
    assert section["signature"]["inputs"][0]["shape"] == [-1, 8]

    assert detect_format(archive) is ArchiveFormat(fmt)

    result = predict(archive, sample_file, "cpu")
    assert np.allclose(np.asarray(result), reference_output(SAMPLE)[0], atol=1e-5)


def test_zip_store_is_stored_and_default_is_deflated(
    torchscript_file: Path, make_archive: ArchiveFactory, tmp_path: Path
) -> None:
    stored = make_archive(torchscript_file, fmt="zip-store", export=tmp_path / "stored")
    deflated = make_archive(torchscript_file, fmt="default", export=tmp_path / "deflated")
    assert stored.name == deflated.name == "tiny.mar"
    with zipfile.ZipFile(stored) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        assert MANIFEST_PATH in zf.namelist()
    with zipfile.ZipFile(deflated) as zf:
        assert zf.getinfo("tiny.pt").compress_type == zipfile.ZIP_DEFLATED
        assert MANIFEST_PATH in zf.namelist()


def test_tgz_puts_every_entry_under_the_model_folder(
    torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    archive = make_archive(torchscript_file, fmt="tgz")
    assert archive.name == "tiny.tar.gz"
    with tarfile.open(archive, "r:gz") as tf:
        names = tf.getnames()
    assert all(n.startswith("tiny/") for n in names), names
    assert {"tiny/MAR-INF/MANIFEST.json", "tiny/tiny.pt", "tiny/sample.json"} <= set(names)


def test_no_archive_is_a_directory_with_the_manifest(
    torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    archive = make_archive(torchscript_file, fmt="no-archive")
    assert archive.is_dir()
    assert sorted(p.relative_to(archive).as_posix() for p in archive.rglob("*") if p.is_file()) == [
        MANIFEST_PATH,
        "sample.json",
        "tiny.pt",
    ]
    # Used in place: opening and closing it must leave the directory alone.
    with open_archive(archive) as reader:
        assert reader.root == archive.resolve()
    assert (archive / "tiny.pt").is_file()


def test_extra_files_directory_is_copied_flat_and_wildcards_expand(
    torchscript_file: Path, make_archive: ArchiveFactory, tmp_path: Path
) -> None:
    assets = tmp_path / "assets"
    (assets / "sub").mkdir(parents=True)
    (assets / "labels.txt").write_text("cat\ndog\n")
    (assets / "sub" / "vocab.txt").write_text("a b c\n")
    # What torch-model-archiver leaves out: caches, bytecode, Finder files, dot folders.
    (assets / "__pycache__").mkdir()
    (assets / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"\x00")
    (assets / "helper.pyc").write_bytes(b"\x00")
    (assets / ".DS_Store").write_bytes(b"\x00")
    (assets / "sub" / ".DS_Store").write_bytes(b"\x00")
    (assets / ".git").mkdir()
    (assets / ".git" / "config").write_text("[core]\n")
    (assets / "sub" / ".cache").mkdir()
    (assets / "sub" / ".cache" / "blob").write_text("x")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.md").write_text("a")
    (notes / "b.md").write_text("b")
    (notes / "c.txt").write_text("c")

    extra = ["--extra-files", f"{assets},{notes}/*.md"]
    archive = make_archive(torchscript_file, extra=extra)
    with zipfile.ZipFile(archive) as zf:
        names = set(zf.namelist())
        assert zf.read("sub/vocab.txt") == b"a b c\n"
    assert names == {
        MANIFEST_PATH,
        "tiny.pt",
        "sample.json",
        "labels.txt",
        "sub/vocab.txt",
        "a.md",
        "b.md",
    }
    with open_archive(archive) as reader:
        assert reader.manifest.scriptserve is not None
        assert set(reader.manifest.scriptserve.files) == names - {MANIFEST_PATH}
        assert reader.verify().ok


def test_extra_files_wildcard_matching_nothing_fails(
    torchscript_file: Path, make_archive: ArchiveFactory, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exc:
        make_archive(torchscript_file, extra=["--extra-files", f"{tmp_path}/nothing/*.md"])
    assert exc.value.code == 1


def _minimal_spec(tmp_path: Path, version: str) -> ArchiveSpec:
    payload = tmp_path / "payload.txt"
    payload.write_text(version)
    manifest = Manifest(model=ModelInfo("tiny", version, "tensor", serialized_file="model.pt"))
    return ArchiveSpec(manifest, {"payload.txt": payload})


@pytest.mark.parametrize("fmt", list(ArchiveFormat))
def test_existing_archive_needs_force(fmt: ArchiveFormat, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = build_archive(_minimal_spec(tmp_path, "1.0"), store, fmt)
    with pytest.raises(ArchiveError, match=r"already exists.*-f/--force") as exc:
        build_archive(_minimal_spec(tmp_path, "2.0"), store, fmt)
    assert first.name in str(exc.value)
    with open_archive(first) as reader:
        assert reader.manifest.model.model_version == "1.0"

    again = build_archive(_minimal_spec(tmp_path, "2.0"), store, fmt, force=True)
    assert again == first
    with open_archive(again) as reader:
        assert reader.manifest.model.model_version == "2.0"
    # Staging folders are removed: only the archive is left in the store.
    assert [p.name for p in store.iterdir()] == [first.name]


def test_model_archiver_without_force_exits_1_naming_the_file(
    torchscript_file: Path,
    make_archive: ArchiveFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    archive = make_archive(torchscript_file)
    before = archive.read_bytes()
    capsys.readouterr()
    argv = [
        "--model-name", "tiny", "--version", "2.0", "--serialized-file", str(torchscript_file),
        "--input-shape", "8", "--export-path", str(archive.parent),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        model_archiver_main(argv)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("model-archiver: error:")
    assert "tiny.mar" in err
    assert "--force" in err
    assert archive.read_bytes() == before
