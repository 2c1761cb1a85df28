"""The built-in `text_classifier` handler: texts in, top-k `{label: probability}` out.

For sequence classifiers (BERT, RoBERTa, DistilBERT, ... `ForSequenceClassification`) whose
archive packs their `tokenizer.json`: texts are tokenized and batched by length
(handlers/tokenized.py), the model's first output is read as one row of logits per text.
Labels and `topk` as handlers/labels.py says. A request of one text is answered with its
`{label: probability}`, one of several texts with a list of them; Open Inference Protocol
requests get the logits as the `logits` tensor, a row per text.

TorchServe's own `text_classifier` (archives made by torch-model-archiver) is served by the
TorchServe compatibility layer, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scriptserve.handlers.base import Context, HandlerError, InferenceResponse
from scriptserve.handlers.labels import DEFAULT_TOPK, read_labels, top_classes, topk
from scriptserve.handlers.tokenized import TextBatch, TextHandler

LOGITS = "logits"


class TextClassifier(TextHandler):
    def initialize(self, context: Context) -> None:
        super().initialize(context)
        self.labels = read_labels(context.model_dir)
        self.topk = int(context.model_config.get("topk", DEFAULT_TOPK))

    def row_outputs(
        self, outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray]
    ) -> Sequence[np.ndarray]:
        logits = next(iter(outputs.values()))
        rows = next(iter(inputs.values())).shape[0]
        if logits.ndim != 2 or logits.shape[0] != rows:
            raise HandlerError(
                f"the model returned shape {list(logits.shape)} for {rows} texts; the text "
                "classifier needs (batch, classes) scores"
            )
        return list(logits)

    def postprocess(self, outputs: TextBatch) -> list[InferenceResponse]:
        results: dict[int, InferenceResponse] = dict(outputs.errors)
        for request, rows in self.request_rows(outputs).items():
            try:
                k = topk(outputs.parameters[request], self.topk)
            except ValueError as exc:
                results[request] = InferenceResponse.failed(str(exc))
                continue
            answers = [top_classes(scores, k, self.labels) for _, scores in rows]
            body: Any = answers[0] if len(answers) == 1 else answers
            logits = np.stack([scores for _, scores in rows]).astype(np.float32)
            results[request] = InferenceResponse(outputs={LOGITS: logits}, body=body)
        return [results[i] for i in range(outputs.size)]
