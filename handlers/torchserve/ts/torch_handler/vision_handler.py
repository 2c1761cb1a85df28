"""`ts.torch_handler.vision_handler.VisionHandler`: images (bytes, base64 or lists) to a batch.

TorchServe uses torchvision transforms; these are the same steps with Pillow and torch:
resize the shorter side to 256 (bilinear), centre-crop 224, scale to [0, 1], normalize with
the ImageNet mean and standard deviation. Images are converted to RGB first.
"""

from __future__ import annotations

import base64
import io
from abc import ABC
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ..utils.util import PredictionException
from .base_handler import BaseHandler

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class ImagePipeline:
    """Resize(resize) -> CenterCrop(crop) -> ToTensor -> Normalize(mean, std)."""

    def __init__(
        self,
        resize: int = 256,
        crop: int = 224,
        mean: tuple[float, ...] = MEAN,
        std: tuple[float, ...] = STD,
    ) -> None:
        self.resize = resize
        self.crop = crop
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = image.convert("RGB")
        w, h = image.size
        if w <= h:
            size = (self.resize, int(self.resize * h / w))
        else:
            size = (int(self.resize * w / h), self.resize)
        image = image.resize(size, Image.Resampling.BILINEAR)
        w, h = image.size
        top = round((h - self.crop) / 2.0)
        left = round((w - self.crop) / 2.0)
        image = image.crop((left, top, left + self.crop, top + self.crop))
        array = np.asarray(image, dtype=np.float32) / 255.0
        tensor = torch.from_numpy(array).permute(2, 0, 1)
        return (tensor - self.mean) / self.std


class VisionHandler(BaseHandler, ABC):
    image_processing: Any = ImagePipeline()

    def initialize(self, context: Any) -> None:
        super().initialize(context)
        self.ig = None
        self.initialized = True

    def preprocess(self, data: Any) -> torch.Tensor:
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            if isinstance(image, str):
                image = base64.b64decode(image)
            if isinstance(image, (bytearray, bytes)):
                try:
                    picture = Image.open(io.BytesIO(image))
                except UnidentifiedImageError:
                    raise PredictionException(
                        "the request is not an image Pillow can read (send JPEG or PNG bytes)", 400
                    ) from None
                images.append(self.image_processing(picture))
            else:
                images.append(torch.FloatTensor(image))
        return torch.stack(images).to(self.device)
