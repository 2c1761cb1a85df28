"""The built-in `image_classifier` handler on a real archive: images, tensors, batching, errors.

The model scores ten brightness classes: class c wins when the mean of the preprocessed image
is closest to c / 9, so a uniform gray image of value v is class round(v / 255 * 9).
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.base import Context, InferenceRequest, InferenceResponse
from scriptserve.handlers.image_classifier import ImageClassifierHandler, Preprocessing, preset
from scriptserve.handlers.loader import load_handler, read_model_config

LABELS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class Brightness(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(1, 2, 3)).unsqueeze(1)
        centers = torch.arange(10, dtype=x.dtype) / 9.0
        return -((mean - centers) ** 2) * 400.0


@pytest.fixture(scope="module")
def handler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageClassifierHandler]:
    yield from _served(tmp_path_factory.mktemp("imgcls"))


def _served(root: Path) -> Iterator[ImageClassifierHandler]:
    from scriptserve.archiver.cli import model_archiver_main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(Brightness())
        torch.jit.save(scripted, str(root / "brightness.pt"))
    (root / "sample.json").write_text(json.dumps(np.zeros((1, 8, 8)).tolist()))
    (root / "index_to_name.json").write_text(json.dumps(dict(enumerate(LABELS))))
    (root / "preprocessing.json").write_text(
        json.dumps(
            {"grayscale": True, "resize": [8, 8], "scale": 1 / 255, "mean": [0.0], "std": [1.0]}
        )
    )
    (root / "config.yaml").write_text("topk: 3\n")
    argv = [
        "--model-name", "brightness", "--version", "1.0",
        "--serialized-file", str(root / "brightness.pt"), "--handler", "image_classifier",
        "--sample-input", str(root / "sample.json"), "--config-file", str(root / "config.yaml"),
        "--extra-files", f"{root / 'index_to_name.json'},{root / 'preprocessing.json'}",
        "--export-path", str(root / "store"),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    with open_archive(root / "store" / "brightness.mar") as reader:
        manifest = reader.manifest
        context = Context(
            "brightness", "1.0", reader.root, manifest, read_model_config(reader.root, manifest)
        )
        handler = load_handler(context)
        assert isinstance(handler, ImageClassifierHandler)
        yield handler


def image_bytes(value: int, fmt: str = "PNG", size: int = 8, mode: str = "L") -> bytes:
    color: int | tuple[int, int, int] = value if mode == "L" else (value, value, value)
    buf = io.BytesIO()
    Image.new(mode, (size, size), color).save(buf, format=fmt, quality=95)
    return buf.getvalue()


def run(handler: ImageClassifierHandler, *requests: InferenceRequest) -> list[InferenceResponse]:
    assert handler.context is not None
    return handler.handle(list(requests), handler.context)


def test_png_answers_topk_labels_most_likely_first(handler: ImageClassifierHandler) -> None:
    (response,) = run(handler, InferenceRequest(body=image_bytes(255), content_type="image/png"))
    assert response.status == 200
    assert list(response.body) == ["nine", "eight", "seven"]  # topk 3 from the model config
    assert response.body["nine"] > 0.5
    assert abs(sum(response.body.values()) - 1.0) < 0.2
    assert response.outputs["output0"].shape == (1, 10)


@pytest.mark.parametrize(
    ("value", "fmt", "mode", "size", "label"),
    [
        (0, "PNG", "L", 8, "zero"),
        (142, "JPEG", "L", 8, "five"),
        (57, "PNG", "RGB", 8, "two"),  # converted to grayscale
        (199, "JPEG", "RGB", 64, "seven"),  # resized to 8x8 first
    ],
)
def test_formats_modes_and_sizes(
    handler: ImageClassifierHandler, value: int, fmt: str, mode: str, size: int, label: str
) -> None:
    (response,) = run(handler, InferenceRequest(body=image_bytes(value, fmt, size, mode)))
    assert next(iter(response.body)) == label


def test_batch_with_a_bad_image_fails_only_that_request(handler: ImageClassifierHandler) -> None:
    responses = run(
        handler,
        InferenceRequest(body=image_bytes(28)),
        InferenceRequest(body=b"\x89PNG\r\n\x1a\n truncated", content_type="image/png"),
        InferenceRequest(
            body=image_bytes(228),
            fields={"data": image_bytes(228)},
            content_type="multipart/form-data; boundary=x",
        ),
        InferenceRequest(body=b""),
    )
    assert [r.status for r in responses] == [200, 400, 200, 400]
    assert next(iter(responses[0].body)) == "one"
    assert next(iter(responses[2].body)) == "eight"
    assert "image" in responses[1].error
    assert "no body" in responses[3].error


def test_tensor_input_as_json_and_oip(handler: ImageClassifierHandler) -> None:
    four = np.full((1, 8, 8), 4 / 9, np.float32)
    as_json = InferenceRequest(
        body=json.dumps(four.tolist()).encode(), content_type="application/json"
    )
    batch = np.stack([np.full((1, 8, 8), c / 9, np.float32) for c in (3, 6)])
    as_oip = InferenceRequest(inputs={"x": batch})
    images_oip = InferenceRequest(
        inputs={"x": np.array([image_bytes(255), image_bytes(0)], dtype=object)}
    )
    wrong_shape = InferenceRequest(inputs={"x": np.zeros((2, 3, 8, 8), np.float32)})
    wrong_type = InferenceRequest(inputs={"x": np.zeros((2, 1, 8, 8), np.int32)})
    r_json, r_oip, r_images, r_shape, r_type = run(
        handler, as_json, as_oip, images_oip, wrong_shape, wrong_type
    )
    assert next(iter(r_json.body)) == "four"
    assert [next(iter(b)) for b in r_oip.body] == ["three", "six"]
    assert r_oip.outputs["output0"].argmax(1).tolist() == [3, 6]
    assert [next(iter(b)) for b in r_images.body] == ["nine", "zero"]
    assert r_shape.status == 400 and "shape [2, 3, 8, 8]" in r_shape.error
    assert r_type.status == 400 and "datatype INT32" in r_type.error


def test_topk_request_parameter(handler: ImageClassifierHandler) -> None:
    ok, bad = run(
        handler,
        InferenceRequest(body=image_bytes(255), parameters={"topk": 1}),
        InferenceRequest(body=image_bytes(255), parameters={"topk": "many"}),
    )
    assert list(ok.body) == ["nine"]
    assert bad.status == 400 and "topk" in bad.error


def test_oversized_image_is_refused_before_decoding(handler: ImageClassifierHandler) -> None:
    buf = io.BytesIO()
    Image.new("L", (6000, 6000), 0).save(buf, format="PNG")  # 36 Mpx, compresses to ~40 KB
    (response,) = run(handler, InferenceRequest(body=buf.getvalue()))
    assert response.status == 400 and "6000x6000" in response.error


@pytest.mark.parametrize(
    "keys, mode",
    [
        (preset("imagenet", (6, 5)), "RGB"),
        ({"grayscale": True, "invert": True, "scale": 0.5, "mean": [3.0], "std": [7.0]}, "L"),
    ],
    ids=["imagenet-rgb", "grey-inverted"],
)
def test_the_tensor_is_the_normalisation_formula_per_channel(
    keys: dict[str, object], mode: str
) -> None:
    """`Preprocessing.tensor` computes (pixel * scale - mean) / std per channel (of 255 - pixel
    when inverted), as float32 in (1, C, H, W), from the shaped image's uint8 pixels."""
    pre = Preprocessing.from_dict(keys)
    shape = (6, 5, 3) if mode == "RGB" else (6, 5)
    pixels = np.random.default_rng(4).integers(0, 256, shape, dtype=np.uint8)

    tensor = pre.tensor(Image.fromarray(pixels, mode))

    values = pixels.astype(np.float64)
    values = 255.0 - values if pre.invert else values
    channels = values[None] if values.ndim == 2 else values.transpose(2, 0, 1)
    mean = np.asarray(pre.mean).reshape(-1, 1, 1)
    std = np.asarray(pre.std).reshape(-1, 1, 1)
    expected = ((channels * pre.scale - mean) / std)[None]
    assert tensor.dtype == np.float32 and tensor.shape == (1, pre.channels, 6, 5)
    assert tensor.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(tensor, expected, rtol=1e-6, atol=1e-5)


def test_jpeg_draft_decodes_a_large_photo_reduced_into_nearly_the_same_tensor() -> None:
    """With `jpeg_draft`, a 1280x960 JPEG for a 224x224 ImageNet model is decoded at half its
    size (Pillow's draft), then resized as always: a tensor of the same shape, a little
    different from the full decode's (so the draft did apply), and close to it. A PNG has no
    draft: the same tensor either way."""
    rng = np.random.default_rng(5)
    x = np.linspace(0, 255, 1280)[None, :, None]
    y = np.linspace(0, 255, 960)[:, None, None]
    pixels = (x * 0.6 + y * 0.4 + rng.normal(0, 12, (960, 1280, 3))).clip(0, 255).astype(np.uint8)
    imagenet = preset("imagenet", (224, 224))
    full = ImageClassifierHandler.__new__(ImageClassifierHandler)
    draft = ImageClassifierHandler.__new__(ImageClassifierHandler)
    full.preprocessing = Preprocessing.from_dict(imagenet)
    draft.preprocessing = Preprocessing.from_dict({**imagenet, "jpeg_draft": True})
    full.max_pixels = draft.max_pixels = 25_000_000

    for fmt in ("JPEG", "PNG"):
        body = io.BytesIO()
        Image.fromarray(pixels).save(body, format=fmt)
        whole, reduced = full.image_to_array(body.getvalue()), draft.image_to_array(body.getvalue())
        assert whole.shape == reduced.shape == (1, 3, 224, 224)
        difference = float(np.abs(whole - reduced).mean())
        if fmt == "JPEG":
            assert 0 < difference < 0.05, difference  # 0.008 measured: half a grey level
        else:
            assert difference == 0
