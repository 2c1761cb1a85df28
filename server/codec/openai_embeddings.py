"""OpenAI's embeddings API (`POST /v1/embeddings`), as TEI, vLLM and Triton's OpenAI front end
answer it, for `text_embedder` archives.

    {"model": "minilm", "input": "a text" | ["a", "b"] | [101, 2023, 102] | [[101, 102], ...],
     "encoding_format": "float" | "base64", "dimensions": 256}

Each input (a text, or a list of the tokenizer's token ids) becomes one request, so that a
call's inputs batch together and with other clients'. The answer::

    {"object": "list", "model": "minilm",
     "data": [{"object": "embedding", "index": 0, "embedding": [0.01, ...]}, ...],
     "usage": {"prompt_tokens": 12, "total_tokens": 12}}

`base64` sends each vector as the base64 of its little-endian float32 bytes (what the `openai`
client asks for by default, and decodes); `dimensions` keeps a vector's first N values,
normalised again (Matryoshka embeddings), and may not exceed the model's.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.server.errors import InferenceFailed, InvalidInput

PATH = "/v1/embeddings"
EMBEDDING = "embedding"
TOKENS = "tokens"
FORMATS = ("float", "base64")
_SHAPE = '{"model": "NAME", "input": "a text" or ["texts", ...]}'


@dataclass(frozen=True)
class EmbeddingsCall:
    """One decoded `/v1/embeddings` request."""

    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        return (value,)
    if _token_ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value:
        items: list[str | tuple[int, ...]] = []
        for item in value:
            if isinstance(item, str):
                items.append(item)
            elif _token_ids(item):
                items.append(tuple(item))
            else:
                raise InvalidInput(
                    '"input" must be a string, a list of strings, a list of token ids or a list '
                    "of such lists"
                )
        return tuple(items)
    raise InvalidInput(f'"input" must be a non-empty string or list: send {_SHAPE}')


def decode(body: bytes) -> EmbeddingsCall:
    """The call a body asks for; InvalidInput saying what is wrong."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"an embeddings request is a JSON object: {_SHAPE}")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput(f'"model" must name a served model: {_SHAPE}')
    if "input" not in doc:
        raise InvalidInput(f'"input" is missing: {_SHAPE}')
    encoding = doc.get("encoding_format") or "float"
    if encoding not in FORMATS:
        raise InvalidInput(f'"encoding_format" must be "float" or "base64", not {encoding!r}')
    dimensions = doc.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1
    ):
        raise InvalidInput('"dimensions" must be a positive integer')
    return EmbeddingsCall(model, _inputs(doc["input"]), encoding, dimensions)


def requests(call: EmbeddingsCall, headers: Mapping[str, str]) -> list[InferenceRequest]:
    """One request per input: a text as a one-element BYTES tensor, token ids as `input_ids`."""
    made = []
    for item in call.inputs:
        if isinstance(item, str):
            inputs = {"text": np.array([item.encode()], dtype=np.object_)}
        else:
            inputs = {"input_ids": np.array([item], dtype=np.int64)}
        made.append(InferenceRequest(inputs=inputs, headers=headers))
    return made


def _vector(response: InferenceResponse, dimensions: int | None, model: str) -> np.ndarray:
    found = response.outputs.get(EMBEDDING)
    if found is None or found.ndim != 2 or found.shape[0] != 1:
        raise InvalidInput(
            f"model {model!r} does not answer with embeddings; serve a text_embedder archive "
            "(model-archiver --handler text_embedder)"
        )
    vector: np.ndarray = found[0].astype("<f4", copy=False)
    if dimensions is None:
        return vector
    if dimensions > vector.shape[0]:
        raise InvalidInput(
            f'"dimensions" {dimensions} is more than model {model!r} makes ({vector.shape[0]})'
        )
    kept = vector[:dimensions]
    norm = float(np.linalg.norm(kept))
    shortened: np.ndarray = (kept / norm if norm > 0 else kept).astype("<f4")
    return shortened


def encode(call: EmbeddingsCall, responses: Sequence[InferenceResponse]) -> bytes:
    """OpenAI's answer: one entry per input, in order, and the tokens they took."""
    data = []
    tokens = 0
    for index, response in enumerate(responses):
        vector = _vector(response, call.dimensions, call.model)
        counted = response.outputs.get(TOKENS)
        if counted is None:
            raise InferenceFailed(f"model {call.model!r} did not count its tokens")
        tokens += int(counted.sum())
        embedding: Any = (
            base64.b64encode(vector.tobytes()).decode()
            if call.encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return orjson.dumps({"object": "list", "model": call.model, "data": data, "usage": usage})
