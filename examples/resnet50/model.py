"""ResNet-50 image classification (microsoft/resnet-50's layout), as model-archiver exports it.

The class builds the model from `config.json` beside this file (a Hugging Face
`save_pretrained` folder holds one), and returns the logits alone: a served model answers
tensors, not `ModelOutput`s. Its state dict is the Hugging Face checkpoint's
(`model.safetensors`), key for key.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import ResNetConfig, ResNetForImageClassification


class ResNet50(ResNetForImageClassification):
    def __init__(self) -> None:
        super().__init__(ResNetConfig.from_json_file(Path(__file__).with_name("config.json")))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pixel_values=pixel_values).logits
