"""The trained archives served by `scriptserve serve`: the `.pt2` archive (digits.mar) and the
ONNX one, PNGs over /predictions, tensors over OIP REST and OIP gRPC (tritonclient)."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from PIL import Image
from serving import ServerProcess

from scriptserve.archiver.archive import open_archive
from scriptserve.training import data
from scriptserve.training.run import TrainConfig, TrainResult

# Slow: a training run's archives served.
pytestmark = pytest.mark.slow

Trained = tuple[TrainConfig, TrainResult]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config, _ = trained
    store = tmp_path_factory.mktemp("served") / "store"
    store.mkdir()
    for name in ("digits.mar", "digits-onnx.mar"):
        shutil.copy(config.out / name, store / name)
    proc = ServerProcess(store, "--workers", "1", "--max-batch-delay", "5")
    try:
        yield proc.start(timeout_s=120)
    finally:
        proc.stop()


def recorded_accuracy(config: TrainConfig, archive: str) -> float:
    with open_archive(config.out / archive) as reader:
        assert reader.manifest.scriptserve is not None
        return float(reader.manifest.scriptserve.metrics["testAccuracy"])


def png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image, mode="L").save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("model", ["digits", "digits-onnx"])
def test_png_predictions_reach_the_recorded_accuracy(
    trained: Trained, server: ServerProcess, model: str
) -> None:
    test = data.load_splits(0).test
    url = f"{server.url}/predictions/{model}"

    with httpx.Client(timeout=60) as client:

        def top1(image: np.ndarray) -> str:
            response = client.post(url, content=png(image), headers={"content-type": "image/png"})
            assert response.status_code == 200, response.text
            answer = response.json()
            assert len(answer) == 5 and abs(sum(answer.values()) - 1.0) < 0.05
            return str(next(iter(answer)))  # most likely first

        with ThreadPoolExecutor(4) as pool:  # concurrent requests form batches
            predicted = list(pool.map(top1, test.raw))
    accuracy = float(
        np.mean([p == str(y) for p, y in zip(predicted, test.labels.tolist(), strict=True)])
    )
    archive = "digits.mar" if model == "digits" else "digits-onnx.mar"
    assert accuracy == pytest.approx(recorded_accuracy(trained[0], archive), abs=1 / 270)


def test_oip_tensors_reach_the_recorded_accuracy(trained: Trained, server: ServerProcess) -> None:
    test = data.load_splits(0).test
    inputs = test.images.numpy()
    predicted = []
    with httpx.Client(timeout=60) as client:
        for start in range(0, len(inputs), 90):
            chunk = inputs[start : start + 90]
            body = {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": list(chunk.shape),
                        "data": chunk.reshape(-1).tolist(),
                    }
                ]
            }
            response = client.post(f"{server.url}/v2/models/digits/infer", json=body)
            assert response.status_code == 200, response.text
            (out,) = response.json()["outputs"]
            assert out["shape"] == [len(chunk), 10]
            predicted += np.asarray(out["data"]).reshape(len(chunk), 10).argmax(1).tolist()
    accuracy = float(np.mean(np.asarray(predicted) == test.labels.numpy()))
    assert accuracy == pytest.approx(recorded_accuracy(trained[0], "digits.mar"), abs=1e-9)


def test_oip_grpc_tensors_reach_the_recorded_accuracy(
    trained: Trained, server: ServerProcess
) -> None:
    test = data.load_splits(0).test
    inputs = test.images.numpy()
    client = triton.InferenceServerClient(server.grpc)
    predicted: list[int] = []
    for start in range(0, len(inputs), 90):
        chunk = inputs[start : start + 90]
        tensor = triton.InferInput("x", list(chunk.shape), "FP32")
        tensor.set_data_from_numpy(chunk)
        answer = client.infer("digits", [tensor])
        logits = answer.as_numpy("output0")
        assert logits is not None and logits.shape == (len(chunk), 10)
        predicted += logits.argmax(1).tolist()
    client.close()
    accuracy = float(np.mean(np.asarray(predicted) == test.labels.numpy()))
    assert accuracy == pytest.approx(recorded_accuracy(trained[0], "digits.mar"), abs=1e-9)


def test_the_served_digits_archive_is_a_pt2_package(trained: Trained) -> None:
    with open_archive(trained[0].out / "digits.mar") as reader:
        assert reader.manifest.model_format == "pt2"
        assert reader.manifest.model.serialized_file == "model.pt2"


def test_shipped_seven_png_raw_and_multipart(server: ServerProcess) -> None:
    seven = (REPO / "docs" / "images" / "seven.png").read_bytes()
    with httpx.Client(timeout=60) as client:
        raw = client.put(f"{server.url}/predictions/digits", content=seven)  # curl -T
        multipart = client.post(
            f"{server.url}/predictions/digits", files={"data": ("seven.png", seven, "image/png")}
        )
        bad = client.post(f"{server.url}/predictions/digits", content=b"\x89PNG not really")
    for response in (raw, multipart):
        assert response.status_code == 200, response.text
        assert next(iter(response.json())) == "7"
    assert bad.status_code == 400
    assert "image" in bad.json()["message"] if "message" in bad.json() else "image" in bad.text
