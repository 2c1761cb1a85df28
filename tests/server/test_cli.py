"""`scriptserve archive create|inspect` and `scriptserve predict` through the console script."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from testmodels import reference_output, save_onnx, save_torchscript

from scriptserve.archiver.manifest import MANIFEST_PATH
from scriptserve.server.cli import main

SAMPLE = [0.1 * i for i in range(8)]
EXPECTED = reference_output(np.asarray([SAMPLE], dtype=np.float32))[0]


def scriptserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["scriptserve", *args], capture_output=True, text=True, timeout=120, check=False
    )


def assert_error(done: subprocess.CompletedProcess[str], prog: str, *needles: str) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: error: ")
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny (TorchScript) and tiny-onnx archives, built with `scriptserve archive create`."""
    root = tmp_path_factory.mktemp("cli")
    models = root / "models"
    models.mkdir()
    save_torchscript(models / "tiny.pt")
    save_onnx(models / "tiny.onnx")
    (models / "sample.json").write_text(json.dumps(SAMPLE))
    (models / "short.json").write_text(json.dumps(SAMPLE[:5]))
    (models / "broken.json").write_text("{")
    for name, model, fmt in (("tiny", "tiny.pt", "default"), ("tiny-onnx", "tiny.onnx", "tgz")):
        argv = [
            "archive", "create", "--model-name", name, "--version", "1.0",
            "--serialized-file", str(models / model), "--sample-input",
            str(models / "sample.json"), "--export-path", str(root / "store"),
            "--archive-format", fmt,
        ]  # fmt: skip
        if fmt == "default":
            done = scriptserve(*argv)
            assert done.returncode == 0, done.stderr
            assert done.stdout == f"{root / 'store' / 'tiny.mar'}\n"
        else:  # in-process, to keep the suite fast: one subprocess shows the exit code
            assert main(argv) == 0
    return root


def test_usage_errors_exit_2() -> None:
    for argv in ([], ["predict", "x.mar"], ["archive", "inspect"]):
        done = scriptserve(*argv)
        assert done.returncode == 2, argv
        assert "usage: scriptserve" in done.stderr


def test_inspect_text(store: Path) -> None:
    archive = store / "store" / "tiny.mar"
    done = scriptserve("archive", "inspect", str(archive))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"archive: {archive} (default)\nmanifest:\n")
    assert '"modelName": "tiny"' in out
    tiny_pt = (store / "models" / "tiny.pt").read_bytes()
    file_lines = out.split("files:\n", 1)[1].splitlines()
    assert len(file_lines) == 3
    listed = {line.split()[0]: (int(line.split()[1]), line.split()[2]) for line in file_lines}
    assert listed["tiny.pt"] == (len(tiny_pt), sha256(tiny_pt))
    assert set(listed) == {MANIFEST_PATH, "tiny.pt", "sample.json"}


@pytest.mark.parametrize(("name", "fmt"), [("tiny.mar", "default"), ("tiny-onnx.tar.gz", "tgz")])
def test_inspect_json_lists_every_file_with_size_and_sha256(
    store: Path, name: str, fmt: str
) -> None:
    archive = store / "store" / name
    done = scriptserve("archive", "inspect", "--json", str(archive))
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["archive"] == str(archive)
    assert document["format"] == fmt
    manifest = document["manifest"]
    assert manifest["model"]["modelName"] == archive.name.split(".")[0]
    model_file = manifest["model"]["serializedFile"]

    files = {f["name"]: f for f in document["files"]}
    assert set(files) == {MANIFEST_PATH, model_file, "sample.json"}
    sources = {
        model_file: (store / "models" / model_file).read_bytes(),
        "sample.json": (store / "models" / "sample.json").read_bytes(),
    }
    for file_name, data in sources.items():
        assert files[file_name]["size"] == len(data)
        assert files[file_name]["sha256"] == sha256(data)
        assert manifest["scriptserve"]["files"][file_name] == sha256(data)
    assert files[MANIFEST_PATH]["size"] > 0
    assert len(files[MANIFEST_PATH]["sha256"]) == 64


def test_inspect_json_manifest_hash_matches_the_zip_member(store: Path) -> None:
    archive = store / "store" / "tiny.mar"
    document = json.loads(scriptserve("archive", "inspect", "--json", str(archive)).stdout)
    with zipfile.ZipFile(archive) as zf:
        raw = zf.read(MANIFEST_PATH)
    (entry,) = [f for f in document["files"] if f["name"] == MANIFEST_PATH]
    assert entry == {"name": MANIFEST_PATH, "size": len(raw), "sha256": sha256(raw)}


def test_inspect_missing_archive(tmp_path: Path) -> None:
    done = scriptserve("archive", "inspect", str(tmp_path / "nope.mar"))
    assert_error(done, "scriptserve archive", "archive not found", "nope.mar")


@pytest.mark.parametrize("name", ["tiny.mar", "tiny-onnx.tar.gz"])
def test_predict_prints_the_model_output(store: Path, name: str) -> None:
    done = scriptserve(
        "predict", str(store / "store" / name), "--input", str(store / "models" / "sample.json")
    )
    assert done.returncode == 0, done.stderr
    assert np.allclose(np.asarray(json.loads(done.stdout)), EXPECTED, atol=1e-5)


def test_predict_with_wrong_shaped_input_names_input_and_shape(store: Path) -> None:
    done = scriptserve(
        "predict",
        str(store / "store" / "tiny.mar"),
        "--input",
        str(store / "models" / "short.json"),
    )
    assert_error(
        done,
        "scriptserve predict",
        "input 'x' has shape [5] per instance; the model expects [8]",
    )
    assert done.stdout == ""


def test_predict_with_bad_json_input(store: Path) -> None:
    done = scriptserve(
        "predict",
        str(store / "store" / "tiny-onnx.tar.gz"),
        "--input",
        str(store / "models" / "broken.json"),
    )
    assert_error(done, "scriptserve predict", "not valid JSON")


def test_predict_missing_archive_and_missing_input(store: Path, tmp_path: Path) -> None:
    sample = str(store / "models" / "sample.json")
    done = scriptserve("predict", str(tmp_path / "nope.mar"), "--input", sample)
    assert_error(done, "scriptserve predict", "archive not found")
    done = scriptserve("predict", str(store / "store" / "tiny.mar"), "--input", str(tmp_path))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr


def test_predict_refuses_a_tampered_archive(store: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tiny.mar"
    with (
        zipfile.ZipFile(store / "store" / "tiny.mar") as src,
        zipfile.ZipFile(tampered, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(
                info.filename,
                b"[9, 9, 9, 9, 9, 9, 9, 9]" if info.filename == "sample.json" else data,
            )
    done = scriptserve("predict", str(tampered), "--input", str(store / "models" / "sample.json"))
    assert_error(done, "scriptserve predict", "failed verification", "changed: sample.json")


def test_predict_on_an_unknown_device(store: Path) -> None:
    done = scriptserve(
        "predict",
        str(store / "store" / "tiny-onnx.tar.gz"),
        "--input",
        str(store / "models" / "sample.json"),
        "--device",
        "tpu:0",
    )
    assert_error(done, "scriptserve predict", "unknown device 'tpu:0'")
