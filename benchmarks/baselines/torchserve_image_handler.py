"""A TorchServe 0.12 handler for the zoo's image classifiers, as a TorchServe user writes it
without torchvision (whose PyPI build does not load with the CPU torch): Pillow, then the
TorchScript model. Packed by benchmarks/torchserve.py; TorchServe wants one class per file."""

import io

import numpy as np
import torch
from PIL import Image
from ts.torch_handler.base_handler import BaseHandler

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


class ImageHandler(BaseHandler):
    """JPEG/PNG bytes -> resize 256, centre crop 224, ImageNet normalisation -> top-5 labels."""

    def preprocess(self, data):
        images = []
        for row in data:
            raw = row.get("data") or row.get("body")
            image = Image.open(io.BytesIO(raw)).convert("RGB")
            w, h = image.size
            scale = 256 / min(w, h)
            image = image.resize((round(w * scale), round(h * scale)), Image.BILINEAR)
            w, h = image.size
            left, top = (w - 224) // 2, (h - 224) // 2
            image = image.crop((left, top, left + 224, top + 224))
            array = np.asarray(image, np.float32).transpose(2, 0, 1) / 255.0
            images.append((array - MEAN) / STD)
        return torch.from_numpy(np.stack(images))

    def inference(self, data, *args, **kwargs):
        with torch.inference_mode():
            return self.model(data)

    def postprocess(self, data):
        probs = torch.softmax(data, dim=1)
        top = probs.topk(5, dim=1)
        return [
            {str(int(c)): float(p) for c, p in zip(idx, val, strict=True)}
            for val, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        ]
