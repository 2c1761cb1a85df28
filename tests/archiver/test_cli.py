"""`model-archiver` through its console script: exit codes 0 / 1 / 2 and one-line errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from serving import run_command
from testmodels import save_onnx, save_torchscript

from scriptserve.archiver.archive import open_archive


def model_archiver(*args: str) -> subprocess.CompletedProcess[str]:
    """The `model-archiver` command, forked (serving.run_command); the first test runs the
    installed script itself."""
    return run_command("model-archiver", *args)


def assert_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1 with exactly one `model-archiver: error: ...` line and no traceback."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("model-archiver: error: ")
    for needle in needles:
        assert needle in lines[0]
    assert done.stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    save_torchscript(root / "tiny.pt")
    save_onnx(root / "tiny.onnx")
    (root / "sample.json").write_text(json.dumps([0.5] * 8))
    (root / "short.json").write_text(json.dumps([0.5] * 5))
    (root / "broken.json").write_text("[0.5, 0.5,")
    junk = bytes(range(256)) * 16
    (root / "junk.pt").write_bytes(junk)
    (root / "junk.onnx").write_bytes(junk)
    (root / "tiny.bin").write_bytes(junk)
    return root


def args(models: Path, store: Path, model: str = "tiny.pt", *extra: str) -> list[str]:
    return [
        "--model-name",
        "tiny",
        "--version",
        "1.0",
        "--serialized-file",
        str(models / model),
        "--export-path",
        str(store),
        *extra,
    ]


@pytest.mark.slow
def test_success_prints_the_archive_path(models: Path, tmp_path: Path) -> None:
    sample = str(models / "sample.json")
    argv = args(models, tmp_path, "tiny.pt", "--sample-input", sample)
    done = subprocess.run(
        ["model-archiver", *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "tiny.mar")
    with open_archive(tmp_path / "tiny.mar") as reader:
        assert reader.manifest.model.model_name == "tiny"
        assert reader.verify().ok


@pytest.mark.slow
def test_input_shape_without_sample_for_torchscript(models: Path, tmp_path: Path) -> None:
    done = model_archiver(*args(models, tmp_path, "tiny.pt", "--input-shape", "8"))
    assert done.returncode == 0, done.stderr
    with open_archive(Path(done.stdout.strip())) as reader:
        signature = reader.manifest.signature
        assert reader.manifest.scriptserve is not None
        # A sample is generated for the shape, so that the server's workers warm up on it.
        assert reader.manifest.scriptserve.sample_input == "sample.json"
        sample = json.loads((reader.root / "sample.json").read_text())
        assert reader.verify().ok
    assert len(sample) == 8 and all(isinstance(v, float) for v in sample)
    assert [(t.name, t.datatype, t.shape) for t in signature.inputs] == [("x", "FP32", (-1, 8))]
    assert [(t.name, t.shape) for t in signature.outputs] == [("output0", (-1, 3))]


def test_input_shape_without_sample_for_onnx_takes_the_graphs_input_name(
    models: Path, tmp_path: Path
) -> None:
    """An unnamed --input-shape runs the ONNX graph under its own input name (`x`, not a
    generated `input0` that onnxruntime would refuse)."""
    done = model_archiver(*args(models, tmp_path, "tiny.onnx", "--input-shape", "8"))
    assert done.returncode == 0, done.stderr
    with open_archive(Path(done.stdout.strip())) as reader:
        assert [t.name for t in reader.manifest.signature.inputs] == ["x"]
        sample = json.loads((reader.root / "sample.json").read_text())
    assert len(sample) == 8


REQUIRED = ["--model-name", "m", "--version", "1", "--serialized-file", "m.pt"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        pytest.param(["--version", "1", "--serialized-file", "m.pt"], "--model-name", id="name"),
        pytest.param(["--model-name", "m", "--serialized-file", "m.pt"], "--version", id="ver"),
        pytest.param(["--model-name", "m", "--version", "1"], "--serialized-file", id="file"),
        pytest.param([*REQUIRED, "--archive-format", "rar"], "--archive-format", id="format"),
        pytest.param(
            [*REQUIRED, "--no-such-flag"], "unrecognized arguments: --no-such-flag", id="flag"
        ),
    ],
)
def test_usage_error_exits_2(argv: list[str], needle: str, tmp_path: Path) -> None:
    done = model_archiver(*argv, "--export-path", str(tmp_path))
    assert done.returncode == 2
    assert "usage: model-archiver" in done.stderr
    assert needle in done.stderr.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_missing_serialized_file(models: Path, tmp_path: Path) -> None:
    done = model_archiver(*args(models, tmp_path, "nothing.pt"))
    assert_error(done, "--serialized-file not found", "nothing.pt")
    assert not (tmp_path / "tiny.mar").exists()


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("junk.pt", "does not load as TorchScript"),
        ("junk.onnx", "the ONNX model does not load"),
        ("tiny.bin", "cannot tell the model format of 'tiny.bin'"),
    ],
)
def test_file_that_is_not_a_model(models: Path, tmp_path: Path, model: str, needle: str) -> None:
    assert_error(model_archiver(*args(models, tmp_path, model)), needle)
    assert list(tmp_path.iterdir()) == []


def test_torchscript_sample_of_the_wrong_shape(models: Path, tmp_path: Path) -> None:
    sample = str(models / "short.json")
    line = assert_error(
        model_archiver(*args(models, tmp_path, "tiny.pt", "--sample-input", sample)),
        "failed on the sample input",
        "1x5",
    )
    # The reason, not the TorchScript interpreter's traceback of the scripted code.
    assert "TorchScript interpreter" not in line
    assert not (tmp_path / "tiny.mar").exists()


def test_onnx_sample_of_the_wrong_shape(models: Path, tmp_path: Path) -> None:
    sample = str(models / "short.json")
    assert_error(
        model_archiver(*args(models, tmp_path, "tiny.onnx", "--sample-input", sample)),
        "input 'x' has shape [5] per instance; the model expects [8]",
    )
    assert not (tmp_path / "tiny.mar").exists()


@pytest.mark.parametrize("shape", ["8,x", "x=eight", "8.5"])
def test_invalid_input_shape(models: Path, tmp_path: Path, shape: str) -> None:
    done = model_archiver(*args(models, tmp_path, "tiny.pt", "--input-shape", shape))
    assert_error(done, f"--input-shape {shape!r}", "comma-separated integers")


def test_bad_json_sample(models: Path, tmp_path: Path) -> None:
    sample = str(models / "broken.json")
    done = model_archiver(*args(models, tmp_path, "tiny.pt", "--sample-input", sample))
    assert_error(done, "--sample-input is not valid JSON")


def test_existing_archive_without_force(models: Path, tmp_path: Path) -> None:
    first = model_archiver(*args(models, tmp_path, "tiny.onnx"))
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "tiny.mar").read_bytes()
    again = model_archiver(*args(models, tmp_path, "tiny.onnx", "-v", "2.0"))
    assert_error(again, str(tmp_path / "tiny.mar"), "already exists", "-f/--force")
    assert (tmp_path / "tiny.mar").read_bytes() == before

    forced = model_archiver(*args(models, tmp_path, "tiny.onnx", "-v", "2.0", "-f"))
    assert forced.returncode == 0, forced.stderr
    with open_archive(tmp_path / "tiny.mar") as reader:
        assert reader.manifest.model.model_version == "2.0"


def test_unknown_handler_name(models: Path, tmp_path: Path) -> None:
    done = model_archiver(*args(models, tmp_path, "tiny.onnx", "--handler", "nosuch"))
    assert_error(done, "--handler 'nosuch' is neither a built-in", "nor an existing .py file")
    assert list(tmp_path.iterdir()) == []


def test_handler_file_is_packed(models: Path, tmp_path: Path) -> None:
    handler = tmp_path / "my_handler.py"
    handler.write_text(
        "from handlers.tensor import TensorHandler\n\n\nclass H(TensorHandler): ...\n"
    )
    store = tmp_path / "store"
    done = model_archiver(*args(models, store, "tiny.onnx", "--handler", f"{handler}:H"))
    assert done.returncode == 0, done.stderr
    with open_archive(store / "tiny.mar") as reader:
        assert reader.manifest.model.handler == "my_handler.py:H"
        assert (reader.root / "my_handler.py").read_text() == handler.read_text()
