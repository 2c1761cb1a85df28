"""The TorchScript and ONNX backends: load, run, fail clearly, and serve threads concurrently."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyMLP, reference_output, save_onnx, save_torchscript
from torch import nn

from scriptserve.archiver.manifest import ModelFormat
from scriptserve.handlers.backends import BackendError, ModelBackend, load_backend, parse_device

OUTPUT_NAME: dict[ModelFormat, str] = {"torchscript": "output0", "onnx": "y"}

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class ReshapingMLP(nn.Module):
    """TinyMLP behind a reshape, so a wrong width fails inside the interpreter, not at the door."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(x.shape[0], 4, 2).flatten(1))


def model_file(tmp_path: Path, fmt: ModelFormat) -> Path:
    if fmt == "onnx":
        return save_onnx(tmp_path / "tiny.onnx")
    return save_torchscript(tmp_path / "tiny.pt")


def inputs(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 8)).astype(np.float32)


@pytest.fixture(params=["torchscript", "onnx"])
def fmt(request: pytest.FixtureRequest) -> ModelFormat:
    value: ModelFormat = request.param
    return value


@pytest.fixture
def backend(tmp_path: Path, fmt: ModelFormat) -> ModelBackend:
    return load_backend(model_file(tmp_path, fmt), fmt, device="cpu", intra_op_threads=1)


def test_runs_on_cpu_and_matches_eager_model(backend: ModelBackend, fmt: ModelFormat) -> None:
    x = inputs(5, seed=1)

    outputs = backend.run({"x": x})

    assert backend.device == "cpu"
    assert backend.input_names == ("x",)
    assert set(outputs) == {OUTPUT_NAME[fmt]}
    assert outputs[OUTPUT_NAME[fmt]].shape == (5, 3)
    np.testing.assert_allclose(outputs[OUTPUT_NAME[fmt]], reference_output(x), rtol=1e-5, atol=1e-6)


def test_onnx_backend_names_its_outputs(tmp_path: Path) -> None:
    backend = load_backend(model_file(tmp_path, "onnx"), "onnx", intra_op_threads=1)

    assert backend.output_names == ("y",)


def test_missing_input_is_a_backend_error(backend: ModelBackend) -> None:
    with pytest.raises(BackendError, match=r"^missing model input\(s\): x$"):
        backend.run({"not_x": inputs(1, seed=0)})


def test_torchscript_failure_at_run_time_has_no_traceback(tmp_path: Path) -> None:
    path = save_torchscript(tmp_path / "reshaping.pt", ReshapingMLP())
    backend = load_backend(path, "torchscript", intra_op_threads=1)

    with pytest.raises(BackendError) as info:
        backend.run({"x": np.ones((2, 5), np.float32)})

    message = str(info.value)
    assert message == "the model failed: shape '[2, 4, 2]' is invalid for input of size 10"
    assert "Traceback" not in message
    assert 'File "' not in message


def test_onnx_failure_at_run_time_has_no_traceback(tmp_path: Path) -> None:
    path = save_onnx(tmp_path / "tiny.onnx")
    backend = load_backend(path, "onnx", intra_op_threads=1)

    with pytest.raises(BackendError) as info:
        backend.run({"x": np.ones((2, 5), np.float32)})

    message = str(info.value)
    assert message.startswith("the ONNX model failed: ")
    assert "Expected: 8" in message
    assert "Traceback" not in message
    assert 'File "' not in message


def test_a_file_that_is_no_model_does_not_load(tmp_path: Path, fmt: ModelFormat) -> None:
    path = tmp_path / ("junk.onnx" if fmt == "onnx" else "junk.pt")
    path.write_bytes(b"not a model")

    with pytest.raises(BackendError, match="model does not load"):
        load_backend(path, fmt, intra_op_threads=1)


@pytest.mark.parametrize(
    ("device", "parsed"), [("cpu", ("cpu", 0)), ("cuda", ("cuda", 0)), ("cuda:1", ("cuda", 1))]
)
def test_parse_device_accepts_cpu_and_cuda(device: str, parsed: tuple[str, int]) -> None:
    assert parse_device(device) == parsed


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu:0", "CPU", "cpu:0"])
def test_parse_device_rejects_other_devices(device: str) -> None:
    with pytest.raises(BackendError, match=r"unknown device .*; use 'cpu' or 'cuda:N'"):
        parse_device(device)


def test_load_backend_rejects_an_unknown_device(torchscript_file: Path) -> None:
    with pytest.raises(BackendError, match="unknown device 'tpu'"):
        load_backend(torchscript_file, "torchscript", device="tpu")


def test_one_backend_serves_two_threads_concurrently(
    backend: ModelBackend, fmt: ModelFormat
) -> None:
    runs_per_thread = 50
    # Expected outputs are computed up front: TinyMLP() reseeds torch's global RNG, so building
    # reference models in two threads at once would race.
    work_items = {
        thread: [inputs(1 + run % 4, seed=thread * 1000 + run) for run in range(runs_per_thread)]
        for thread in range(2)
    }
    expected = {t: [reference_output(x) for x in xs] for t, xs in work_items.items()}
    results: dict[int, list[np.ndarray]] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(thread: int) -> None:
        start.wait()
        try:
            for x in work_items[thread]:
                results[thread].append(backend.run({"x": x})[OUTPUT_NAME[fmt]])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    assert not any(t.is_alive() for t in threads)
    assert errors == []
    for thread in range(2):
        assert len(results[thread]) == runs_per_thread
        for got, want in zip(results[thread], expected[thread], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_runs_on_cuda_like_on_cpu(tmp_path: Path, fmt: ModelFormat) -> None:
    if fmt == "onnx":
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            pytest.skip("needs onnxruntime's CUDA build (the gpu extra); this is the CPU one")
    path = model_file(tmp_path, fmt)
    cpu = load_backend(path, fmt, device="cpu", intra_op_threads=1)
    cuda = load_backend(path, fmt, device="cuda:0", intra_op_threads=1)
    x = inputs(16, seed=3)

    on_cuda = cuda.run({"x": x})[OUTPUT_NAME[fmt]]

    assert cuda.device == "cuda:0"
    assert isinstance(on_cuda, np.ndarray)
    np.testing.assert_allclose(on_cuda, cpu.run({"x": x})[OUTPUT_NAME[fmt]], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_torchscript_fp16_on_cuda_stays_close(torchscript_file: Path) -> None:
    backend = load_backend(
        torchscript_file, "torchscript", device="cuda:0", options={"precision": "fp16"}
    )
    x = inputs(16, seed=4)

    out = backend.run({"x": x})["output0"]

    assert out.dtype == np.float32
    np.testing.assert_allclose(out, reference_output(x), atol=1e-2)


@pytest.mark.gpu
@needs_cuda
def test_torchscript_cuda_graphs_answer_as_without_them_at_every_batch_size(
    torchscript_file: Path,
) -> None:
    """Padded to their bucket (the next power of two up to 64), replayed; past 64, without a
    graph. Two threads at once each replay their own graphs."""
    plain = load_backend(torchscript_file, "torchscript", device="cuda:0")
    graphed = load_backend(
        torchscript_file, "torchscript", device="cuda:0", options={"cuda_graphs": True}
    )
    for batch in (1, 3, 8, 33, 64, 100):
        x = inputs(batch, seed=batch)
        np.testing.assert_allclose(
            graphed.run({"x": x})["output0"], plain.run({"x": x})["output0"], atol=1e-5
        )

    def many(seed: int) -> None:
        for batch in (2, 5, 16):
            x = inputs(batch, seed=seed + batch)
            np.testing.assert_allclose(
                graphed.run({"x": x})["output0"], reference_output(x), atol=1e-3
            )

    threads = [threading.Thread(target=many, args=(s,)) for s in (10, 20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_batches_are_padded_to_power_of_two_buckets_up_to_the_bound() -> None:
    from scriptserve.handlers.backends.cuda_streams import bucket_for

    assert [bucket_for(n, 64) for n in (1, 2, 3, 5, 33, 64, 65)] == [1, 2, 4, 8, 64, 64, None]
    assert [bucket_for(n, 24) for n in (9, 17, 24, 25)] == [16, 24, 24, None]
    assert (bucket_for(3, None), bucket_for(64, None), bucket_for(65, None)) == (4, 64, None)


def test_cuda_graphs_for_a_model_on_the_cpu_are_left_off(
    torchscript_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model config may be shared by CPU and GPU deployments: on the CPU the switch is noted
    in the log and the model answers as without it."""
    x = inputs(5, seed=6)
    with caplog.at_level("INFO", logger="scriptserve.handlers"):
        backend = load_backend(torchscript_file, "torchscript", options={"cuda_graphs": "true"})
    assert "cuda_graphs applies to models on GPUs" in caplog.text
    np.testing.assert_allclose(backend.run({"x": x})["output0"], reference_output(x), atol=1e-5)


GPU_BUILD = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
"""What onnxruntime-gpu lists, on any machine (the `gpu` extra)."""


def test_onnx_on_a_gpu_takes_cuda_then_the_cpu_and_tensorrt_only_with_its_cache(
    tmp_path: Path,
) -> None:
    from scriptserve.handlers.backends.onnx import providers

    assert providers("cpu", GPU_BUILD, {}) == ["CPUExecutionProvider"]
    cuda = [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    assert providers("cuda:1", GPU_BUILD, {}, tensorrt=True) == cuda  # no engine cache set
    cache = tmp_path / "trt" / "m-1.0"
    with_cache = {"tensorrt_cache_dir": str(cache)}
    first, *rest = providers("cuda:1", GPU_BUILD, with_cache, tensorrt=True)
    assert rest == cuda
    assert first == (
        "TensorrtExecutionProvider",
        {
            "device_id": 1,
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": str(cache),
        },
    )
    assert cache.is_dir()  # made for TensorRT to write its engines into
    assert providers("cuda:1", GPU_BUILD, with_cache, tensorrt=False) == cuda  # not installed
    opted_out = {**with_cache, "tensorrt": False}
    assert providers("cuda:1", GPU_BUILD, opted_out, tensorrt=True) == cuda
    without_trt = ["CUDAExecutionProvider", "CPUExecutionProvider"]  # a build without it
    assert providers("cuda:1", without_trt, with_cache, tensorrt=True) == cuda


def test_onnx_on_a_gpu_with_the_cpu_build_is_refused_naming_the_gpu_extra(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=r"no CUDA provider: install 'scriptserve\[gpu\]'"):
        load_backend(save_onnx(tmp_path / "tiny.onnx"), "onnx", device="cuda:0")
