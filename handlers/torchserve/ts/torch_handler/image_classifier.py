"""`ts.torch_handler.image_classifier.ImageClassifier`: the top 5 classes of each image.

Each response is `{label: probability}` for the five most probable classes (fewer when the model
has fewer), labels from `index_to_name.json` when the archive has one, else class indices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..utils.util import map_class_to_label
from .vision_handler import VisionHandler


class ImageClassifier(VisionHandler):
    topk = 5

    def set_max_result_classes(self, topk: int) -> None:
        self.topk = topk

    def get_max_result_classes(self) -> int:
        return self.topk

    def postprocess(self, data: torch.Tensor) -> list[dict[Any, float]]:
        ps = F.softmax(data, dim=1)
        probs, classes = torch.topk(ps, min(self.topk, ps.shape[1]), dim=1)
        return map_class_to_label(probs.tolist(), self.mapping, classes.tolist())
