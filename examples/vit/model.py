"""ViT-B/16 image classification (google/vit-base-patch16-224's layout), as model-archiver
exports it: built from `config.json` beside this file, returning the logits alone."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import ViTConfig, ViTForImageClassification


class ViT(ViTForImageClassification):
    def __init__(self) -> None:
        super().__init__(ViTConfig.from_json_file(Path(__file__).with_name("config.json")))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pixel_values=pixel_values).logits
