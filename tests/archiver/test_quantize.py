"""archiver/quantize.py: dynamic int8 of TorchScript (scripted and eager) and ONNX files, the
report, the nothing-to-quantize error, the accuracy guard, and `--quantize`. The load-time cache
is tests/archiver/test_quantize_cache.py."""

from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from testmodels import save_torchscript
from torch import nn

from scriptserve.archiver.archive import open_archive, sha256_file, verify_archive
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.pt2_package import lacks_vnni
from scriptserve.archiver.quantize import (
    QuantizationError,
    QuantizeOptions,
    Tolerance,
    ValidationSamples,
    converter_for,
    quantize_model_file,
)

# int8 outputs of these models stay within this of fp32 on the fixed inputs below.
TOLERANCE = 0.05


class MLP(nn.Module):
    """64 -> 256 -> 256 -> 10: big enough that int8 weights dominate the file."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class ConvOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


EAGER_SOURCE = """
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])
"""


class Tagger(nn.Module):
    """What EAGER_SOURCE defines, for making its state dict and scripting it here."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


X = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
SAMPLE = {"x": X[:1]}


def fp32_of(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return MLP().eval()(torch.from_numpy(x)).numpy()


def run_torchscript(path: Path, x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(path)).eval()  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]


def run_onnx(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]  # type: ignore[no-any-return]


@pytest.fixture
def mlp_pt(tmp_path: Path) -> Path:
    return save_torchscript(tmp_path / "mlp.pt", MLP())


@pytest.fixture
def mlp_onnx(tmp_path: Path) -> Path:
    return _export_onnx(tmp_path / "mlp.onnx", MLP(), (1, 64))


def _export_onnx(path: Path, module: nn.Module, shape: tuple[int, ...]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            (torch.zeros(*shape),),
            str(path),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
            dynamo=False,
        )
    return path


# An untrained MLP has near-tied logits, so a few top-1 classes flip: looser than the defaults.
LOOSE = Tolerance(min_top1_agreement=0.9, max_accuracy_drop=0.1)
LOOSE_FLAGS = ("--min-top1-agreement", "0.9", "--max-accuracy-drop", "0.1")


def labelled(rows: int = 200) -> ValidationSamples:
    x = np.random.default_rng(2).standard_normal((rows, 64)).astype(np.float32)
    return ValidationSamples({"x": x}, labels=fp32_of(x).argmax(1))


# -- conversion --------------------------------------------------------------------------------
def test_torchscript_int8_is_close_smaller_and_reported(mlp_pt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "mlp.int8.pt"
    report = quantize_model_file(mlp_pt, dst, "torchscript", SAMPLE)
    got = run_torchscript(dst, X)
    assert np.max(np.abs(got - fp32_of(X))) < TOLERANCE
    assert report.quantized_ops == {"quantized::linear_dynamic": 3}
    assert report.left_float == {}
    assert report.size_ratio > 3.0
    assert report.source_sha256 == sha256_file(mlp_pt)
    assert report.int8_sha256 == sha256_file(dst)
    assert report.fp32_latency_ms > 0 and report.int8_latency_ms > 0
    assert report.latency_ratio == pytest.approx(report.fp32_latency_ms / report.int8_latency_ms)
    assert 0 < report.max_abs_diff < TOLERANCE
    assert report.engine == torch.backends.quantized.engine


def test_onnx_int8_is_close_smaller_and_reported(mlp_onnx: Path, tmp_path: Path) -> None:
    dst = tmp_path / "mlp.int8.onnx"
    report = quantize_model_file(mlp_onnx, dst, "onnx", SAMPLE)
    assert np.max(np.abs(run_onnx(dst, X) - fp32_of(X))) < TOLERANCE
    assert report.quantized_ops == {"MatMulInteger": 3}
    assert report.size_ratio > 3.0
    assert 0 < report.max_abs_diff < TOLERANCE
    assert report.options["weightType"] == "qint8"


def test_onnx_options_reach_onnxruntime(mlp_onnx: Path, tmp_path: Path) -> None:
    per_tensor = quantize_model_file(mlp_onnx, tmp_path / "a.onnx", "onnx", SAMPLE)
    options = QuantizeOptions(weight_type="quint8", per_channel=True, reduce_range=True)
    report = quantize_model_file(mlp_onnx, tmp_path / "b.onnx", "onnx", SAMPLE, options)
    assert report.options["perChannel"] and report.options["reduceRange"]
    # Per-channel scales are stored per output row: a different, larger file.
    assert report.int8_bytes != per_tensor.int8_bytes
    assert np.max(np.abs(run_onnx(tmp_path / "b.onnx", X) - fp32_of(X))) < 2 * TOLERANCE


def test_eager_model_file_with_state_dict_converts_lstm(tmp_path: Path) -> None:
    source = tmp_path / "tagger.py"
    source.write_text(EAGER_SOURCE)
    torch.manual_seed(0)
    model = Tagger().eval()
    weights = tmp_path / "tagger.pth"
    torch.save(model.state_dict(), weights)
    x = np.random.default_rng(3).standard_normal((4, 6, 16)).astype(np.float32)
    dst = tmp_path / "tagger.int8.pt"
    options = QuantizeOptions(model_file=source)
    report = quantize_model_file(weights, dst, "torchscript", {"x": x[:1]}, options)
    assert report.left_float == {}
    assert any("lstm" in op for op in report.quantized_ops), report.quantized_ops
    assert any("linear_dynamic" in op for op in report.quantized_ops), report.quantized_ops
    with torch.inference_mode():
        expected = model(torch.from_numpy(x)).numpy()
    assert np.max(np.abs(run_torchscript(dst, x) - expected)) < TOLERANCE


def test_scripted_lstm_is_reported_as_left_in_fp32(tmp_path: Path) -> None:
    src = save_torchscript(tmp_path / "tagger.pt", Tagger())
    x = np.zeros((1, 6, 16), np.float32)
    report = quantize_model_file(src, tmp_path / "q.pt", "torchscript", {"x": x})
    assert report.left_float == {"LSTM": 1}
    assert report.quantized_ops == {"quantized::linear_dynamic": 1}


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_conv_only_model_has_nothing_to_quantize(tmp_path: Path, fmt: str) -> None:
    if fmt == "onnx":
        src = _export_onnx(tmp_path / "conv.onnx", ConvOnly(), (1, 1, 8, 8))
    else:
        src = save_torchscript(tmp_path / "conv.pt", ConvOnly())
    dst = tmp_path / f"conv.int8{src.suffix}"
    sample = {"x": np.zeros((1, 1, 8, 8), np.float32)}
    with pytest.raises(QuantizationError, match="nothing to quantize") as exc:
        quantize_model_file(src, dst, fmt, sample)  # type: ignore[arg-type]
    assert "conv" in str(exc.value).lower()  # names the ops it found
    assert "serve it in fp32" in str(exc.value)
    assert not dst.exists()


def test_a_pt2_file_is_quantized_only_when_it_is_compiled(mlp_pt: Path, tmp_path: Path) -> None:
    """A compiled package holds no graph to quantize: the error says where int8 .pt2 is made."""
    assert converter_for("onnx").suffix == ".onnx"
    with pytest.raises(QuantizationError) as exc:
        quantize_model_file(mlp_pt, tmp_path / "q.pt2", "pt2", SAMPLE)
    assert str(exc.value).startswith(
        "a .pt2 package is quantized when it is compiled: model-archiver --export-pt2 "
        "--quantize dynamic-int8 (or static-int8)"
    )
    assert not (tmp_path / "q.pt2").exists()


def test_no_deprecation_warning_escapes(mlp_pt: Path, tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize_model_file(mlp_pt, tmp_path / "q.pt", "torchscript", SAMPLE)
    leaked = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert leaked == [], [str(w.message) for w in leaked]


# -- accuracy guard ---------------------------------------------------------------------------
def test_guard_measures_agreement_and_accuracy(mlp_pt: Path, tmp_path: Path) -> None:
    report = quantize_model_file(
        mlp_pt, tmp_path / "q.pt", "torchscript", SAMPLE, None, labelled(), LOOSE
    )
    v = report.validation
    assert v is not None and v.samples == 200
    assert v.top1_agreement is not None and v.top1_agreement >= 0.9
    assert v.fp32_accuracy == 1.0  # the labels are fp32's own classes
    assert v.int8_accuracy == v.top1_agreement
    assert 0 < v.max_abs_diff < TOLERANCE


@pytest.mark.parametrize(
    ("tolerance", "message"),
    [
        (Tolerance(min_top1_agreement=1.01), "top-1 class agrees with fp32"),
        (Tolerance(max_abs_diff=1e-9), "max |int8 - fp32|"),
        (Tolerance(min_cosine=1.01, measure="cosine"), "cosine similarity of its output"),
        (Tolerance(min_top1_agreement=0.0, max_accuracy_drop=-0.5), "top-1 accuracy falls"),
    ],
)
def test_guard_refuses_over_tolerance(
    mlp_onnx: Path, tmp_path: Path, tolerance: Tolerance, message: str
) -> None:
    dst = tmp_path / "q.onnx"
    with pytest.raises(QuantizationError, match="int8 refused") as exc:
        quantize_model_file(mlp_onnx, dst, "onnx", SAMPLE, None, labelled(), tolerance)
    assert message in str(exc.value)
    assert not dst.exists()


def test_guard_uses_recorded_fp32_outputs(mlp_pt: Path, tmp_path: Path) -> None:
    x = labelled().inputs["x"]
    wrong = ValidationSamples({"x": x}, expected={"output0": -fp32_of(x)})
    with pytest.raises(QuantizationError, match="top-1"):
        quantize_model_file(mlp_pt, tmp_path / "q.pt", "torchscript", SAMPLE, validation=wrong)


def test_validation_file_round_trip_and_training_layout(tmp_path: Path) -> None:
    samples = labelled(10)
    loaded = ValidationSamples.load(samples.save(tmp_path / "v.npz"))
    assert np.array_equal(loaded.inputs["x"], samples.inputs["x"])
    assert loaded.labels is not None and np.array_equal(loaded.labels, samples.labels)
    # training/ writes one array per input name plus labels, as np.savez does.
    np.savez(tmp_path / "t.npz", x=np.zeros((3, 4), np.float32), labels=np.arange(3))
    assert set(ValidationSamples.load(tmp_path / "t.npz").inputs) == {"x"}
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 4), np.float32), labels=np.arange(2))
    with pytest.raises(QuantizationError, match="same rows"):
        ValidationSamples.load(tmp_path / "bad.npz")


# -- model-archiver --quantize --------------------------------------------------------------------
def archive_argv(model: Path, export: Path, *extra: str) -> list[str]:
    sample = export.parent / "sample.json"
    sample.write_text(json.dumps(X[0].tolist()))
    return [
        "--model-name",
        "mlp",
        "--version",
        "1.0",
        "--serialized-file",
        str(model),
        "--sample-input",
        str(sample),
        "--export-path",
        str(export),
        "-f",
        *extra,
    ]


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_model_archiver_writes_int8_and_records_it(tmp_path: Path, fmt: str) -> None:
    model = (
        save_torchscript(tmp_path / "mlp.pt", MLP())
        if fmt == "torchscript"
        else _export_onnx(tmp_path / "mlp.onnx", MLP(), (1, 64))
    )
    validation = labelled(50).save(tmp_path / "validation.npz")
    argv = archive_argv(
        model,
        tmp_path / "store",
        "--quantize",
        "dynamic-int8",
        "--validation-file",
        str(validation),
        *LOOSE_FLAGS,
    )
    assert model_archiver_main(argv) == 0
    archive = tmp_path / "store" / "mlp.mar"
    assert verify_archive(archive).ok
    with open_archive(archive) as reader:
        info = reader.manifest.scriptserve
        assert info is not None
        q = info.quantization
        served = reader.root / (reader.manifest.model.serialized_file or "")
        assert served.name == f"mlp.int8{model.suffix}"
        assert info.validation_samples == "validation.npz"
        assert info.signature.inputs[0].shape == (-1, 64)
        run = run_torchscript if fmt == "torchscript" else run_onnx
        assert np.max(np.abs(run(served, X) - fp32_of(X))) < TOLERANCE
    assert q.mode == "dynamic-int8"
    assert q.source_sha256 == sha256_file(model)
    assert q.size_ratio is not None and q.size_ratio > 3.0
    assert q.latency_ratio is not None and q.latency_ratio > 0
    assert q.max_abs_diff is not None and 0 < q.max_abs_diff < TOLERANCE
    assert q.details["appliedAt"] == "archive"
    assert q.details["validation"]["samples"] == 50
    assert q.details["options"]["reduceRange"] is lacks_vnni()
    with zipfile.ZipFile(archive) as zf:
        manifest = json.loads(zf.read("MAR-INF/MANIFEST.json"))
    assert manifest["scriptserve"]["quantization"]["sourceSha256"] == sha256_file(model)
    assert "mlp.pt" not in zf.namelist() and "mlp.onnx" not in zf.namelist()


@pytest.mark.parametrize(
    ("features", "lacks"),
    [
        (("sse4_2", "avx", "avx2", "fma3"), True),
        (("avx2", "avx512_f", "avx512_vnni"), False),
        (("avx2", "avx_vnni"), False),
        (("avx2", "avx512_f", "amx_tile", "amx_int8"), False),
        (("asimd", "neon"), False),
    ],
)
def test_reduce_range_defaults_on_only_for_x86_cpus_without_vnni(
    features: tuple[str, ...], lacks: bool
) -> None:
    assert lacks_vnni(features) is lacks


def test_reduce_range_can_be_set_either_way(mlp_onnx: Path, tmp_path: Path) -> None:
    for chosen in (False, True):
        options = QuantizeOptions(reduce_range=chosen)
        report = quantize_model_file(mlp_onnx, tmp_path / f"{chosen}.onnx", "onnx", SAMPLE, options)
        assert report.options["reduceRange"] is chosen
    assert QuantizeOptions().key()["reduceRange"] is lacks_vnni()


def test_model_archiver_conv_only_fails_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = save_torchscript(tmp_path / "conv.pt", ConvOnly())
    argv = [
        "--model-name", "conv", "--version", "1", "--serialized-file", str(model),
        "--input-shape", "1,8,8", "--export-path", str(tmp_path / "store"),
        "--quantize", "dynamic-int8",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        model_archiver_main(argv)
    assert exc.value.code == 1
    assert "nothing to quantize" in capsys.readouterr().err
    assert not (tmp_path / "store" / "conv.mar").exists()


def test_model_archiver_guard_refuses(
    mlp_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    validation = labelled(50).save(tmp_path / "validation.npz")
    argv = archive_argv(
        mlp_pt,
        tmp_path / "store",
        "--quantize",
        "dynamic-int8",
        "--validation-file",
        str(validation),
        *LOOSE_FLAGS,
        "--max-abs-diff",
        "0.000001",
    )
    with pytest.raises(SystemExit):
        model_archiver_main(argv)
    assert "int8 refused" in capsys.readouterr().err
    assert not (tmp_path / "store" / "mlp.mar").exists()


def test_model_archiver_eager_source(tmp_path: Path) -> None:
    source = tmp_path / "tagger.py"
    source.write_text(EAGER_SOURCE)
    weights = tmp_path / "tagger.pth"
    torch.save(Tagger().state_dict(), weights)
    argv = [
        "--model-name", "tagger", "--version", "1", "--serialized-file", str(weights),
        "--model-file", str(source), "--input-shape", "6,16",
        "--export-path", str(tmp_path / "store"), "--quantize", "dynamic-int8",
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    with open_archive(tmp_path / "store" / "tagger.mar") as reader:
        assert reader.manifest.model.serialized_file == "tagger.int8.pt"
        q = reader.manifest.scriptserve.quantization  # type: ignore[union-attr]
        assert q.source_sha256 == sha256_file(weights)
        assert any("lstm" in op for op in q.details["quantizedOps"])
