"""What an image costs the image classifier before the model sees it, per image, on one thread.

    python -m benchmarks.preprocess [--rounds 7 --images 200]

For each input (JPEGs of a photo's usual sizes, resized and centre-cropped with the ImageNet
preset for a 224 x 224 model; the digits model's 28 x 28 greyscale PNG), the median over rounds
of `image_to_array` (the handler's whole preprocessing) and of its stages apart: decode to RGB,
resize and crop (`Preprocessing.shape`), and the tensor (pixels to normalised float32, C x H x
W: `Preprocessing.tensor`, one multiply and one add per value from the uint8 pixels). Beside
it, the textbook formula, `(float(pixels) * scale - mean) / std` in float32 passes (the
handler's way until 2026-11-27), with the ratio of the two taken in each round. The larger
JPEGs are also timed with `jpeg_draft` (decoded at a reduced scale where the resize allows).
Results go to benchmarks/results/preprocess-<date>.json with the CPU.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from benchmarks import report
from scriptserve.handlers.image_classifier import ImageClassifierHandler, Preprocessing, preset

SIZES = ((320, 240), (640, 480), (1280, 960))
"""JPEG sizes (width, height) for the ImageNet preset."""


def photo(width: int, height: int) -> bytes:
    """A JPEG with a photo's spread of values (smooth gradients and noise), not a flat fill."""
    rng = np.random.default_rng(width)
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    pixels = (x * 0.6 + y * 0.4 + rng.normal(0, 12, (height, width, 3))).clip(0, 255)
    body = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(body, format="JPEG", quality=90)
    return body.getvalue()


def digit() -> bytes:
    body = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 255, (28, 28), np.uint8)).save(
        body, format="PNG"
    )
    return body.getvalue()


def handler(pre: Preprocessing) -> ImageClassifierHandler:
    """The handler with its preprocessing set as `initialize` sets it, without a model."""
    made = ImageClassifierHandler.__new__(ImageClassifierHandler)
    made.preprocessing = pre
    made.max_pixels = 25_000_000
    return made


def textbook_tensor(pre: Preprocessing, image: Image.Image) -> np.ndarray:
    """Pixels to the model's tensor in float32 passes, as the formula is written."""
    array = np.asarray(image, dtype=np.float32)
    array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
    mean = np.asarray(pre.mean, dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(pre.std, dtype=np.float32).reshape(-1, 1, 1)
    out: np.ndarray = ((array * np.float32(pre.scale) - mean) / std)[None]
    return out.astype(np.float32)


def decode(data: bytes, pre: Preprocessing) -> Image.Image:
    """The image decoded as the handler decodes it (at a reduced scale with `jpeg_draft`)."""
    return pre.decode(Image.open(io.BytesIO(data)))


def per_item_ms(call: Callable[[], object], images: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(images):
        call()
    return (time.perf_counter() - start) / images * 1000


def measure(
    label: str, data: bytes, pre: Preprocessing, rounds: int, images: int
) -> dict[str, Any]:
    made = handler(pre)
    decoded = decode(data, pre)
    shaped = pre.shape(decoded)
    ours = made.image_to_array(data)
    textbook = textbook_tensor(pre, shaped)
    if ours.shape != textbook.shape or not np.allclose(ours, textbook, atol=1e-5, rtol=0):
        raise AssertionError(f"{label}: the handler's tensor differs from the formula's")
    stages: dict[str, Callable[[], object]] = {
        "whole": lambda: made.image_to_array(data),
        "decode": lambda: decode(data, pre),
        "geometry": lambda: pre.shape(decoded),
        "tensor": lambda: pre.tensor(shaped),
        "tensor_textbook": lambda: textbook_tensor(pre, shaped),
    }
    timed: dict[str, list[float]] = {k: [] for k in stages}
    for _ in range(rounds):
        for key, call in stages.items():
            timed[key].append(per_item_ms(call, images))
    ratios = [b / a for a, b in zip(timed["tensor"], timed["tensor_textbook"], strict=True)]
    found = {f"{k}_ms": statistics.median(v) for k, v in timed.items()}
    return {**found, "tensor_speedup": statistics.median(ratios), "bytes": len(data)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--images", type=int, default=200, help="images per timing")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    imagenet = Preprocessing.from_dict(preset("imagenet", (224, 224)), (224, 224))
    digits = Preprocessing.from_dict(
        {"grayscale": True, "resize": [28, 28], "mean": [0.1307], "std": [0.3081]}, (28, 28)
    )
    drafted = Preprocessing.from_dict({**preset("imagenet", (224, 224)), "jpeg_draft": True})
    inputs = [(f"JPEG {w}x{h}, ImageNet 224", photo(w, h), imagenet) for w, h in SIZES]
    inputs += [(f"JPEG {w}x{h}, jpeg_draft", photo(w, h), drafted) for w, h in SIZES[1:]]
    inputs.append(("PNG 28x28 grey, digits", digit(), digits))
    results = {}
    print(f"{'input':<30}{'whole':>9}{'decode':>9}{'geometry':>10}{'tensor':>9}{'textbook':>10}")
    for label, data, pre in inputs:
        r = measure(label, data, pre, args.rounds, args.images)
        results[label] = r
        print(
            f"{label:<30}{r['whole_ms']:>9.3f}{r['decode_ms']:>9.3f}{r['geometry_ms']:>10.3f}"
            f"{r['tensor_ms']:>9.3f}{r['tensor_textbook_ms']:>10.3f}"
            f"   tensor {r['tensor_speedup']:.1f}x the textbook's"
        )
    print(f"ms per image, median of {args.rounds} rounds of {args.images} images, one thread")
    found = report.closing({}, load_before)
    report.write_results("preprocess", {"host": found, "inputs": results, "rounds": args.rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
