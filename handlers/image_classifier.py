"""The built-in `image_classifier` handler: images or tensors in, top-k `{label: probability}` out.

A request brings an image (PNG, JPEG, ... as the raw body of `/predictions`, or a multipart field,
or OIP BYTES tensor elements) or an already preprocessed tensor (a JSON array for `/predictions`,
a FP32 tensor over OIP). Images go through the preprocessing the archive records in
`preprocessing.json` (or the `preprocessing` mapping of its model config)::

    {"grayscale": true, "invert": false, "resize": [32, 32], "resample": "bilinear",
     "scale": 0.00392156862745098, "mean": [0.3059], "std": [0.3241], "input": "x"}

`"jpeg_draft": true` decodes a JPEG at a reduced scale where the resize needs no more of it
(several times faster for a large photo; slightly other pixels than a full decode). `"preset":
"imagenet"` stands for what torchvision's and Hugging Face's ImageNet models expect:
RGB, the shorter side resized to 256/224 of the model's size (`resize_shorter`), the centre
cropped to the model's size (`center_crop`), ImageNet's mean and standard deviation. Keys given
beside a preset override it. Without any preprocessing, the archive's signature decides: a model
of 3-channel images ([-1, 3, H, W]) gets the ImageNet preset at its H x W, a model of 1-channel
images greyscale resized to its H x W.

Labels and `topk` as handlers/labels.py says. The answer to one image is `{label: probability}`
for the `topk` most likely classes, most likely first; OIP responses carry the model's outputs
(logits). All images of a batch run as one model call; an image that does not decode fails alone
with 400.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
)
from scriptserve.handlers.labels import (
    DEFAULT_TOPK,
    read_json_object,
    read_labels,
    top_classes,
    topk,
)
from scriptserve.handlers.runtime.signature import (
    Signature,
    SignatureError,
    arrays_from_json,
    datatype_of,
)

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

log = logging.getLogger("handlers.image_classifier")

# An image larger than this is refused before it is decoded (a decompression bomb guard that does
# not touch Pillow's process-wide MAX_IMAGE_PIXELS).
DEFAULT_MAX_PIXELS = 25_000_000
_RESAMPLE = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_CROP_RATIO = 224 / 256
"""The centre crop's share of the resized image in ImageNet evaluation (224 of 256)."""


def preset(name: str, size: tuple[int, int] | None) -> dict[str, Any]:
    """The preprocessing keys a preset stands for, for a model of `size` (height, width)."""
    if name != "imagenet":
        raise HandlerError(f"unknown preprocessing preset {name!r}; use 'imagenet'")
    height, width = size or (224, 224)
    return {
        "grayscale": False,
        "resize_shorter": round(min(height, width) / IMAGENET_CROP_RATIO),
        "center_crop": [height, width],
        "resample": "bilinear",
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
    }


class BadInput(ValueError):
    """One request's input that cannot be used; fails that request alone with 400."""


@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes the model's input tensor (C, H, W)."""

    grayscale: bool = True
    invert: bool = False
    resize: tuple[int, int] | None = None  # (height, width)
    resize_shorter: int | None = None
    """Resize so that the shorter side has this many pixels, keeping the aspect ratio."""
    center_crop: tuple[int, int] | None = None  # (height, width), after resize_shorter
    resample: str = "bilinear"
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    input: str | None = None
    jpeg_draft: bool = False
    """Decode a JPEG at 1/2, 1/4 or 1/8 of its size where the resize needs no more (Pillow's
    `draft`): a large photo decodes and resizes several times faster, into slightly other pixels
    than the reference pipeline's full decode (torchvision's Resize on it), so off unless set."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], size: tuple[int, int] | None = None) -> Preprocessing:
        """Preprocessing from its keys (a `preset` first, the other keys over it); `size` is
        the model's (height, width), which a preset fits."""
        if data.get("preset") is not None:
            data = {**preset(str(data["preset"]), size), **data}
        try:
            resize = _pair(data.get("resize"))
            crop = _pair(data.get("center_crop"))
            shorter = data.get("resize_shorter")
            pre = cls(
                grayscale=bool(data.get("grayscale", True)),
                invert=bool(data.get("invert", False)),
                resize=resize,
                resize_shorter=int(shorter) if shorter else None,
                center_crop=crop,
                resample=str(data.get("resample", "bilinear")).lower(),
                scale=float(data.get("scale", 1.0 / 255.0)),
                mean=tuple(float(m) for m in data.get("mean", [0.0])),
                std=tuple(float(s) for s in data.get("std", [1.0])),
                input=str(data["input"]) if data.get("input") else None,
                jpeg_draft=bool(data.get("jpeg_draft", False)),
            )
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise HandlerError(f"the archive's preprocessing is invalid: {exc}") from None
        channels = 1 if pre.grayscale else 3
        if pre.resample not in _RESAMPLE:
            raise HandlerError(f"preprocessing resample must be one of {', '.join(_RESAMPLE)}")
        if len(pre.mean) not in (1, channels) or len(pre.std) not in (1, channels):
            raise HandlerError(f"preprocessing mean and std need 1 or {channels} values")
        if any(s == 0 for s in pre.std):
            raise HandlerError("preprocessing std must not be 0")
        return pre

    @property
    def channels(self) -> int:
        return 1 if self.grayscale else 3

    def draft_size(self, width: int, height: int) -> tuple[int, int] | None:
        """The least size (width, height) the resize needs of an image this large, for
        `jpeg_draft`; None where the geometry needs the full image (a crop alone)."""
        if self.resize_shorter is not None:
            factor = self.resize_shorter / min(width, height)
            return (math.ceil(width * factor), math.ceil(height * factor))
        if self.resize is not None:
            return (self.resize[1], self.resize[0])
        return None

    def decode(self, image: PILImage) -> PILImage:
        """An opened image decoded in the model's mode (L or RGB); a JPEG at a reduced scale
        with `jpeg_draft`, where the resize needs no more of it."""
        mode = "L" if self.grayscale else "RGB"
        wanted = self.draft_size(*image.size) if self.jpeg_draft else None
        if wanted is not None and image.format == "JPEG":
            image.draft(mode, wanted)
        return image.convert(mode)

    def shape(self, image: PILImage) -> PILImage:
        """A decoded image resized and cropped to the model's height and width."""
        from PIL import Image

        resample = getattr(Image.Resampling, self.resample.upper())
        if self.resize_shorter is not None:
            width, height = image.size
            factor = self.resize_shorter / min(width, height)
            scaled = (max(1, round(width * factor)), max(1, round(height * factor)))
            image = image.resize(scaled, resample)
        if self.center_crop is not None:
            crop_h, crop_w = self.center_crop
            width, height = image.size
            left, top = (width - crop_w) // 2, (height - crop_h) // 2
            image = image.crop((left, top, left + crop_w, top + crop_h))
        if self.resize is not None:
            height_px, width_px = self.resize
            image = image.resize((width_px, height_px), resample)
        return image

    def tensor(self, image: PILImage) -> np.ndarray:
        """A shaped image -> (1, C, H, W) float32: (pixel * scale - mean) / std, per channel,
        computed as one multiply and one add per value from the uint8 pixels: a fifth of the
        time of the four float32 passes the formula reads as (`python -m
        benchmarks.preprocess`)."""
        pixels = np.asarray(image)  # uint8, H x W (x C)
        channels = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        std = np.asarray(self.std, dtype=np.float64)
        factor = self.scale / std
        offset = -np.asarray(self.mean, dtype=np.float64) / std
        if self.invert:  # (255 - pixel) * factor + offset
            offset, factor = offset + 255.0 * factor, -factor
        out = np.empty((1, *channels.shape), dtype=np.float32)
        np.multiply(channels, factor.astype(np.float32).reshape(-1, 1, 1), out=out[0])
        out[0] += offset.astype(np.float32).reshape(-1, 1, 1)
        return out


def _pair(value: Any) -> tuple[int, int] | None:
    """(height, width) from [h, w] or one number for both; None for nothing."""
    if not value:
        return None
    if isinstance(value, int):
        return (value, value)
    return (int(value[0]), int(value[1]))


@dataclass
class _Item:
    index: int
    rows: int
    parameters: dict[str, Any]


@dataclass
class ImageBatch:
    """Decoded requests, the one model input they form, and the per-request failures."""

    size: int
    items: list[_Item] = field(default_factory=list)
    arrays: list[np.ndarray] = field(default_factory=list)
    errors: dict[int, InferenceResponse] = field(default_factory=dict)
    logits: np.ndarray | None = None
    output_name: str = "output0"


class ImageClassifierHandler(BaseHandler):
    thread_safe = True  # per-batch state lives in ImageBatch, never on self

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        config = context.model_config
        signature = context.signature
        pre_file = context.model_dir / "preprocessing.json"
        given: dict[str, Any] | None = None
        if pre_file.is_file():
            given = read_json_object(pre_file)
        elif isinstance(config.get("preprocessing"), dict):
            given = config["preprocessing"]
        self.input_name = (
            (given or {}).get("input")
            or (signature.inputs[0].name if signature.inputs else None)
            or self.model.input_names[0]
        )
        spec = signature.input(self.input_name)
        shape = spec.shape[1:] if spec is not None else ()
        image = len(shape) == 3 and min(shape) > 0
        size = (shape[1], shape[2]) if image else None
        if given is None and image and shape[0] == 3:
            given = {"preset": "imagenet"}  # the signature says RGB: what ImageNet models take
        self.preprocessing = Preprocessing.from_dict(given or {}, size)
        pre = self.preprocessing
        if size is not None and pre.resize is None and pre.center_crop is None:
            self.preprocessing = replace(pre, resize=size)
        self.labels = read_labels(context.model_dir)
        self.topk = int(config.get("topk", DEFAULT_TOPK))
        self.max_pixels = int(config.get("max_image_pixels", DEFAULT_MAX_PIXELS))
        self.instance_shape: tuple[int, ...] | None = shape if shape else None

    # -- preprocess ---------------------------------------------------------------------------
    def image_to_array(self, data: bytes) -> np.ndarray:
        """One encoded image -> (1, C, H, W) float32, as the archive's preprocessing says."""
        from PIL import Image, UnidentifiedImageError

        pre = self.preprocessing
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > self.max_pixels:
                    raise BadInput(
                        f"the image is {width}x{height} pixels, more than the "
                        f"{self.max_pixels} this model accepts; send a smaller image"
                    )
                converted = pre.decode(image)
        except BadInput:
            raise
        except UnidentifiedImageError:
            raise BadInput(
                "the input is neither an image (PNG, JPEG, ...) nor a JSON tensor; "
                "send an image file or the model's input as a JSON array"
            ) from None
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise BadInput(f"the image does not decode ({exc}); send a valid image file") from None
        return pre.tensor(pre.shape(converted))

    def _check_tensor(self, array: np.ndarray) -> np.ndarray:
        got = datatype_of(array.dtype)
        if got != "FP32":
            raise BadInput(f"input {self.input_name!r} has datatype {got}; the model expects FP32")
        want = self.instance_shape
        if want is not None and (
            array.ndim != len(want) + 1
            or any(w not in (-1, g) for w, g in zip(want, array.shape[1:], strict=True))
        ):
            raise BadInput(
                f"input {self.input_name!r} has shape {list(array.shape)}; the model expects "
                f"[-1, {', '.join(str(d) for d in want)}] (-1 = any size), or send an image"
            )
        if array.shape[0] < 1:
            raise BadInput(f"input {self.input_name!r} has no rows")
        return np.ascontiguousarray(array)

    def _decode(self, request: InferenceRequest) -> np.ndarray:
        if request.inputs:
            if len(request.inputs) != 1:
                raise BadInput(f"send one input ({self.input_name!r}): an image or a tensor")
            (array,) = request.inputs.values()
            if array.dtype == np.object_:  # OIP BYTES: one encoded image per element
                images = [self.image_to_array(bytes(b)) for b in array.reshape(-1)]
                if not images:
                    raise BadInput("the BYTES input holds no images")
                return np.concatenate(images)
            return self._check_tensor(array)
        body = request.body
        if not body:
            raise BadInput("the request has no body; send an image (PNG, JPEG) or a JSON tensor")
        content_type = (request.content_type or "").lower()
        if "json" in content_type or body.lstrip()[:1] in (b"[", b"{"):
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise BadInput(f"the body is not valid JSON: {exc}") from None
            if isinstance(data, dict) and isinstance(data.get("data"), list):
                data = data["data"]
            try:
                arrays = arrays_from_json(
                    data, self.context.signature if self.context else Signature()
                )
            except SignatureError as exc:
                raise BadInput(str(exc)) from None
            if len(arrays) != 1:
                raise BadInput(f"send one input ({self.input_name!r})")
            (array,) = arrays.values()
            return self._check_tensor(array.astype(np.float32, copy=False))
        return self.image_to_array(body)

    def preprocess(self, requests: list[InferenceRequest]) -> ImageBatch:
        batch = ImageBatch(size=len(requests))
        for i, request in enumerate(requests):
            try:
                array = self._decode(request)
            except BadInput as exc:
                log.info("model %s request %s: %s", self._model_name(), request.request_id, exc)
                batch.errors[i] = InferenceResponse.failed(str(exc), 400)
                continue
            batch.items.append(_Item(i, array.shape[0], dict(request.parameters)))
            batch.arrays.append(array)
        return batch

    def _model_name(self) -> str:
        return self.context.model_name if self.context else "?"

    # -- inference ----------------------------------------------------------------------------
    def inference(self, batch: ImageBatch) -> ImageBatch:
        if not batch.arrays:
            return batch
        feed = batch.arrays[0] if len(batch.arrays) == 1 else np.concatenate(batch.arrays)
        try:
            outputs = self.model.run({self.input_name: feed})
        except BackendError as exc:
            for item in batch.items:
                batch.errors[item.index] = InferenceResponse.failed(str(exc), exc.status)
            batch.items = []
            return batch
        logits = next(iter(outputs.values()))
        if logits.ndim != 2 or logits.shape[0] != feed.shape[0]:
            raise HandlerError(
                f"the model returned shape {list(logits.shape)} for {feed.shape[0]} images; "
                "the image classifier needs (batch, classes) scores"
            )
        batch.output_name = next(iter(outputs))
        batch.logits = logits
        return batch

    # -- postprocess --------------------------------------------------------------------------
    def top_classes(self, logits: np.ndarray, k: int) -> dict[str, float]:
        """The k most likely classes of one row of scores, by label, most likely first."""
        return top_classes(logits, k, self.labels)

    def postprocess(self, outputs: ImageBatch) -> list[InferenceResponse]:
        results: dict[int, InferenceResponse] = dict(outputs.errors)
        start = 0
        for item in outputs.items:
            assert outputs.logits is not None
            rows = outputs.logits[start : start + item.rows]
            start += item.rows
            try:
                k = topk(item.parameters, self.topk)
            except ValueError as exc:
                results[item.index] = InferenceResponse.failed(str(exc))
                continue
            answers = [self.top_classes(row, k) for row in rows]
            body: Any = answers[0] if len(answers) == 1 else answers
            results[item.index] = InferenceResponse(outputs={outputs.output_name: rows}, body=body)
        return [results[i] for i in range(outputs.size)]
