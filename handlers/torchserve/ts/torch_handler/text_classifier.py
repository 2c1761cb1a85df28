"""`ts.torch_handler.text_classifier.TextClassifier`: class probabilities of one text.

The model takes (token ids, offsets), as an `nn.EmbeddingBag` classifier does. Like TorchServe's,
it reads only the first request of a batch, so the server gives it batches of one.
Response: `{label: probability}` for every class, labels from `index_to_name.json`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..utils.util import PredictionException, map_class_to_label
from .text_handler import TextHandler, ngrams_iterator


class TextClassifier(TextHandler):
    ngrams = 2
    supports_batching = False

    def preprocess(self, data: Any) -> torch.Tensor:
        line = data[0]
        text = line.get("data") or line.get("body")
        if isinstance(text, (bytes, bytearray)):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                raise PredictionException("the text is not UTF-8", 400) from None
        if not isinstance(text, str):
            raise PredictionException("send the text as the request body (plain text)", 400)
        text = self._remove_accented_characters(text)
        text = self._expand_contractions(text)
        text = self._remove_html_tags(text)
        text = self._remove_punctuation(text)
        tokens = self._tokenize(text)
        assert self.source_vocab is not None
        ids = [self.source_vocab[token] for token in ngrams_iterator(tokens, self.ngrams)]
        if not ids:
            raise PredictionException("the text has no words", 400)
        return torch.as_tensor(ids, device=self.device)

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        offsets = torch.as_tensor([0], device=self.device)
        return super().inference(data, offsets)

    def postprocess(self, data: torch.Tensor) -> list[dict[Any, float]]:
        probs = F.softmax(data, dim=1 if data.dim() > 1 else 0)
        rows = probs.tolist()
        return map_class_to_label(rows if data.dim() > 1 else [rows], self.mapping)
