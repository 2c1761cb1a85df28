"""The zoo's models (examples/zoo.py, small sizes) through model-archiver in every format:
`.pt2` fp32 and int8, TorchScript and ONNX. Each archive answers as the eager model does, within
the tolerance its format allows; int8 packages run oneDNN's int8 kernels with no operator left
to a proxy executor, and agree with fp32 on the validation samples."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from zoo_archives import ZooStore, archive_as, zoo_reference

from examples.zoo import IMAGE_CLASSES, VALIDATION_IMAGES
from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.pt2_package import read_package
from scriptserve.handlers.base import Context, InferenceRequest, run_batch
from scriptserve.handlers.image_classifier import IMAGENET_MEAN, IMAGENET_STD
from scriptserve.handlers.loader import load_handler, read_model_config

# Slow: the zoo's models, built and compiled for the session.
pytestmark = pytest.mark.slow


def served(archive: Path, *requests: InferenceRequest) -> list[object]:
    with open_archive(archive) as reader:
        manifest = reader.manifest
        config = read_model_config(reader.root, manifest)
        context = Context(manifest.model.model_name, "1.0", reader.root, manifest, config)
        return list(run_batch(load_handler(context), list(requests), context))


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def imagenet(data: bytes, side: int) -> np.ndarray:
    """ImageNet evaluation preprocessing, written out: shorter side to side*256/224, centre
    crop, scale, normalise."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    short = round(side / (224 / 256))
    w, h = image.size
    image = image.resize(
        (round(w * short / min(w, h)), round(h * short / min(w, h))), Image.Resampling.BILINEAR
    )
    w, h = image.size
    left, top = (w - side) // 2, (h - side) // 2
    image = image.crop((left, top, left + side, top + side))
    array = np.asarray(image, np.float32).transpose(2, 0, 1) / 255.0
    mean = np.array(IMAGENET_MEAN, np.float32).reshape(3, 1, 1)
    std = np.array(IMAGENET_STD, np.float32).reshape(3, 1, 1)
    return ((array - mean) / std)[None]


@pytest.mark.parametrize("name", ["resnet50", "vit"])
def test_an_rgb_model_gets_imagenet_preprocessing_from_its_signature(
    zoo: ZooStore, name: str
) -> None:
    """No preprocessing.json: the signature's [-1, 3, 32, 32] says RGB at 32 x 32."""
    archive = zoo.archive(name)
    images = [jpeg(64, 48, 0), jpeg(40, 90, 1)]

    answers = served(archive, *(InferenceRequest(body=b) for b in images))

    for data, answer in zip(images, answers, strict=True):
        assert answer.error is None, answer.error  # type: ignore[attr-defined]
        expected = zoo_reference(zoo.model(name), {"pixel_values": imagenet(data, 32)})
        logits = answer.outputs["output0"]  # type: ignore[attr-defined]
        np.testing.assert_allclose(logits, expected, atol=1e-4)
    with open_archive(archive) as reader:
        # --input-shape made the archive; its generated sample is kept for the warm-up.
        assert reader.manifest.scriptserve is not None
        assert reader.manifest.scriptserve.sample_input == "sample.json"
        assert np.asarray(json.loads((reader.root / "sample.json").read_text())).shape == (
            3,
            32,
            32,
        )


def test_static_int8_resnet_runs_int8_convolutions_and_no_proxy_calls(zoo: ZooStore) -> None:
    archive = zoo.archive("resnet50", "static-int8")

    with open_archive(archive) as reader:
        manifest = reader.manifest
        package = read_package(reader.root / manifest.model.serialized_file)  # type: ignore[operator]
    assert manifest.scriptserve is not None
    quantization = manifest.scriptserve.quantization
    assert quantization.mode == "static-int8"
    assert not package.uses_proxy_executor()
    kernels = quantization.details["quantizedOps"]
    assert any(k.startswith("aoti_torch_cpu__qconv") for k in kernels), kernels
    validation = quantization.details["validation"]
    assert validation["top1_agreement"] >= 0.99 and validation["min_cosine"] >= 0.99
    assert quantization.details["isa"] in ("AMX", "AVX512-VNNI", "AVX-VNNI", "AVX2", "AVX512")


@pytest.mark.parametrize("quantize", ["dynamic-int8", "static-int8"])
def test_int8_vit_runs_int8_kernels_and_agrees_with_fp32(zoo: ZooStore, quantize: str) -> None:
    """Dynamic and static (the patch embedding's convolution too): built at the accuracy
    guard's default, oneDNN's int8 kernels, no operator left to a proxy executor, top-1
    agreement with fp32 of at least 99 % on the validation images."""
    with open_archive(zoo.archive("vit", quantize)) as reader:
        manifest = reader.manifest
        package = read_package(reader.root / manifest.model.serialized_file)  # type: ignore[operator]
    assert manifest.scriptserve is not None
    quantization = manifest.scriptserve.quantization
    assert quantization.mode == quantize
    assert not package.uses_proxy_executor()
    kernels = quantization.details["quantizedOps"]
    assert any(k.startswith("aoti_torch_cpu__qlinear") for k in kernels), kernels
    if quantize == "static-int8":
        assert any(k.startswith("aoti_torch_cpu__qconv") for k in kernels), kernels
    validation = quantization.details["validation"]
    assert validation["samples"] == VALIDATION_IMAGES
    assert validation["top1_agreement"] >= 0.99 and validation["min_cosine"] >= 0.99


@pytest.mark.parametrize("model", ["resnet50", "vit"])
def test_an_image_classifiers_head_is_fitted_to_its_task(zoo: ZooStore, model: str) -> None:
    """The validation images are of the task the head was fitted to (on images of its own):
    the model names their classes, each by a clear margin, as a trained model does, so int8
    agreement with fp32 measures quantization, not ties between random classes."""
    built = zoo.model(model)
    with np.load(built.validation) as data:
        pixels = data["pixel_values"]
    logits = zoo_reference(built, {"pixel_values": pixels})
    labels = np.arange(len(pixels)) % IMAGE_CLASSES
    assert (logits.argmax(axis=1) == labels).mean() >= 0.9
    best_two = np.sort(logits, axis=1)[:, -2:]
    assert np.median(best_two[:, 1] - best_two[:, 0]) > 1.0


def test_dynamic_int8_embedder_keeps_its_sequence_bound_and_its_vectors_direction(
    zoo: ZooStore,
) -> None:
    archive = zoo.archive("embedder", "dynamic-int8")
    with open_archive(archive) as reader:
        manifest = reader.manifest
    assert manifest.scriptserve is not None and manifest.scriptserve.pt2 is not None
    assert manifest.scriptserve.pt2.max_seq_len == 64
    quantization = manifest.scriptserve.quantization
    assert any("qlinear" in k for k in quantization.details["quantizedOps"])
    # An embedder is guarded by cosine similarity, not by the argmax of its vector.
    assert quantization.details["validation"]["min_cosine"] >= 0.99
    texts = [b"the quick brown fox", b"music film book " * 10]
    fp32 = served(zoo.archive("embedder"), *(InferenceRequest(body=t) for t in texts))
    int8 = served(archive, *(InferenceRequest(body=t) for t in texts))
    for a, b in zip(fp32, int8, strict=True):
        assert float(np.dot(a.body, b.body)) >= 0.99  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
@pytest.mark.parametrize("name", ["bert", "embedder", "resnet50", "vit"])
def test_torchscript_and_onnx_archives_answer_as_the_eager_model(
    zoo: ZooStore, name: str, fmt: str, tmp_path: Path
) -> None:
    built = zoo.model(name)
    archive = archive_as(built, fmt, tmp_path)

    with np.load(built.validation) as data:
        inputs = {n: data[n][:3] for n in data.files}
    expected = zoo_reference(built, inputs)
    if name == "embedder":  # the handler normalises the model's vectors
        expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    (answer,) = served(archive, InferenceRequest(inputs=inputs))
    assert answer.error is None, answer.error  # type: ignore[attr-defined]
    got = next(iter(answer.outputs.values()))  # type: ignore[attr-defined]
    np.testing.assert_allclose(got, expected, atol=1e-4)
    if built.model.kind == "text":  # longer than the model's 64 positions: cut to the bound
        with open_archive(archive) as reader:
            assert reader.manifest.scriptserve is not None
            assert reader.manifest.scriptserve.max_seq_len == 64
        (long,) = served(archive, InferenceRequest(body=b"music film book " * 100))
        assert long.error is None, long.error  # type: ignore[attr-defined]


def test_a_hugging_face_safetensors_checkpoint_loads_as_the_state_dict(
    zoo: ZooStore, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    from scriptserve.archiver.model_source import load_eager_model

    built = zoo.model("bert")
    state = torch.load(built.weights, weights_only=True)
    save_file(state, str(tmp_path / "model.safetensors"))

    model = load_eager_model(built.model_file, tmp_path / "model.safetensors", "BertClassifier")

    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
