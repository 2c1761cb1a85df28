"""TextGenerator: greedy text generation, streamed a token at a time (builtin `text_generator`).

The model is a next-token model over bytes: it takes a window of token ids (`[batch, window]`
int64, the last `window` bytes of the text so far, zero-padded on the left) and returns logits
over the 256 byte values for the next one (`[batch, 256]`), as a TorchScript, `.pt2` or ONNX
file. The window is the archive's recorded input width, or the model config's `window`.

A request brings its prompt as the `text_input` tensor (Open Inference Protocol, Triton's
generate), as a JSON body `{"text_input": "...", "max_tokens": 8}` (application/json, or any
body without a content type that reads as one, as gRPC's `input` fields) or as plain text
(`/predictions`); `max_tokens` (a request parameter, or in the JSON body) bounds its answer,
at most the model config's `max_tokens` (default 64). Requests of one batch generate together,
one model call per step for all of them; each gets a part per token, the token's text as both
the `text_output` tensor and the body, and its last token is its final part.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
)

VOCABULARY = 256
DEFAULT_MAX_TOKENS = 64
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"


@dataclass
class _Prompt:
    tokens: list[int]
    max_tokens: int


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise HandlerError(f"{what} must be a positive integer", 400)
    try:
        number = int(value)
    except ValueError:
        raise HandlerError(f"{what} must be a positive integer", 400) from None
    if number < 1 or number != float(value):
        raise HandlerError(f"{what} must be a positive integer", 400)
    return number


def _json_body(body: bytes, content_type: str | None) -> dict[str, Any] | None:
    """The `{"text_input": ..., "max_tokens": ...}` document of a JSON body: one sent as
    application/json, or one without a content type (gRPC `input` fields have none) that reads
    as such a document; None for plain text."""
    declared = (content_type or "").startswith("application/json")
    if not declared and (content_type or not body.lstrip().startswith(b"{")):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get(TEXT_INPUT), str):
        return doc
    if declared:
        raise HandlerError('send {"text_input": "...", "max_tokens": N}', 400)
    return None


class TextGenerator(BaseHandler):
    thread_safe = True  # the generation's state lives in `stream`'s locals

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        config = context.model_config
        self.max_tokens = _positive_int(config.get("max_tokens", DEFAULT_MAX_TOKENS), "max_tokens")
        self.input_name = self.model.input_names[0]
        spec = context.signature.input(self.input_name)
        width = spec.shape[-1] if spec is not None and spec.shape else None
        window = config.get("window", width if width and width > 0 else None)
        if window is None:
            raise HandlerError(
                "the model's window is unknown: archive it with a sample input of token ids, "
                "or set `window` in its model config"
            )
        self.window = _positive_int(window, "window")

    def _prompt(self, request: InferenceRequest) -> _Prompt:
        limit: Any = request.parameters.get("max_tokens", self.max_tokens)
        text: bytes | None = None
        tokens: list[int] | None = None
        if TEXT_INPUT in request.inputs:
            value = request.inputs[TEXT_INPUT].ravel()[0]
            text = value if isinstance(value, bytes) else str(value).encode()
        elif self.input_name in request.inputs:  # token ids, as the archive's sample gives them
            tokens = [int(t) for t in request.inputs[self.input_name].ravel()]
        elif request.body is not None:
            text = request.body
            doc = _json_body(request.body, request.content_type)
            if doc is not None:
                text = doc[TEXT_INPUT].encode()
                limit = doc.get("max_tokens", limit)
        if tokens is None:
            if not text:
                raise HandlerError(f"the request has no prompt: send {TEXT_INPUT}", 400)
            tokens = list(text)
        if any(not 0 <= t < VOCABULARY for t in tokens):
            raise HandlerError(f"token ids must be in 0..{VOCABULARY - 1}", 400)
        max_tokens = _positive_int(limit, "max_tokens")
        if max_tokens > self.max_tokens:
            raise HandlerError(
                f"max_tokens {max_tokens} is more than this model generates ({self.max_tokens})",
                400,
            )
        return _Prompt(tokens, max_tokens)

    def _windows(self, texts: list[list[int]]) -> np.ndarray:
        batch = np.zeros((len(texts), self.window), dtype=np.int64)
        for row, tokens in enumerate(texts):
            tail = tokens[-self.window :]
            batch[row, self.window - len(tail) :] = tail
        return batch

    def stream(self, requests: list[InferenceRequest]) -> Iterator[list[InferenceResponse | None]]:
        prompts: list[_Prompt | None] = []
        refused: list[InferenceResponse | None] = []
        for request in requests:  # a bad request fails alone; the others generate
            try:
                prompts.append(self._prompt(request))
                refused.append(None)
            except HandlerError as exc:
                prompts.append(None)
                refused.append(InferenceResponse(error=exc.message, status=exc.status, final=True))
        if any(refused):
            yield refused
        texts = [list(prompt.tokens) if prompt else [] for prompt in prompts]
        limits = [prompt.max_tokens if prompt else 0 for prompt in prompts]
        for step in range(max(limits)):
            active = [i for i, limit in enumerate(limits) if step < limit]
            logits = self.model.run({self.input_name: self._windows([texts[i] for i in active])})
            chosen = np.asarray(next(iter(logits.values()))).argmax(axis=-1)
            parts: list[InferenceResponse | None] = [None] * len(requests)
            for i, token in zip(active, chosen.tolist(), strict=True):
                texts[i].append(int(token))
                piece = bytes([int(token)])
                parts[i] = InferenceResponse(
                    outputs={TEXT_OUTPUT: np.array([piece], dtype=object)},
                    body=piece,
                    content_type="text/plain; charset=utf-8",
                    final=step == limits[i] - 1,
                )
            yield parts
