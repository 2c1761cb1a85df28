"""The built-in `text_embedder` handler: texts in, one embedding vector per text out (sentence
embedders: BERT/MiniLM/E5/BGE-style encoders), and what `POST /v1/embeddings` answers with.

Texts are tokenized and batched by length (handlers/tokenized.py). The model's output (the
model config's `embedding_output`, else its first) is either one vector per text ([rows, dim]:
the model pools itself) or one per token ([rows, tokens, dim]: a plain encoder such as
`BertModel`), which is mean-pooled over the text's tokens (its attention mask), as
sentence-transformers pools. Vectors are L2-normalised unless the model config says
`normalize: false`.

A request of one text is answered with its vector (a JSON list of floats), one of several texts
with a list of them. Tensor protocols get `embedding` (FP32, [texts, dim]) and `tokens` (INT64,
[texts]: each text's token count, what `/v1/embeddings` reports as usage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scriptserve.handlers.base import Context, HandlerError, InferenceResponse
from scriptserve.handlers.tokenized import TextBatch, TextHandler

EMBEDDING = "embedding"
TOKENS = "tokens"


class TextEmbedder(TextHandler):
    def initialize(self, context: Context) -> None:
        super().initialize(context)
        config = context.model_config
        self.output_name: str | None = config.get("embedding_output")
        names = tuple(self.model.output_names)
        if self.output_name is not None and self.output_name not in names:
            raise HandlerError(
                f"embedding_output {self.output_name!r} is not an output of the model "
                f"({', '.join(names)})"
            )
        self.normalize = bool(config.get("normalize", True))

    def row_outputs(
        self, outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray]
    ) -> Sequence[np.ndarray]:
        values = outputs[self.output_name] if self.output_name else next(iter(outputs.values()))
        mask = inputs.get("attention_mask")
        ids = next(iter(inputs.values()))
        if mask is None:
            mask = np.ones_like(ids)
        if values.ndim == 3 and values.shape[:2] == ids.shape:
            weights = mask.astype(np.float32)[:, :, None]
            pooled = (values * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        elif values.ndim == 2 and values.shape[0] == ids.shape[0]:
            pooled = values
        else:
            raise HandlerError(
                f"the model returned shape {list(values.shape)} for {ids.shape[0]} texts of "
                f"{ids.shape[1]} tokens; the text embedder needs [texts, dim] or "
                "[texts, tokens, dim]"
            )
        pooled = pooled.astype(np.float32)
        if self.normalize:
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            pooled = pooled / np.maximum(norms, 1e-12)
        return list(pooled)

    def postprocess(self, outputs: TextBatch) -> list[InferenceResponse]:
        results: dict[int, InferenceResponse] = dict(outputs.errors)
        for request, rows in self.request_rows(outputs).items():
            vectors = np.stack([vector for _, vector in rows])
            tokens = np.array([len(row.ids) for row, _ in rows], dtype=np.int64)
            body: Any = vectors[0].tolist() if len(rows) == 1 else vectors.tolist()
            results[request] = InferenceResponse(
                outputs={EMBEDDING: vectors, TOKENS: tokens}, body=body
            )
        return [results[i] for i in range(outputs.size)]
