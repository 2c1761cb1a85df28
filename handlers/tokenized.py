"""Texts in, the model's token tensors out: what the `text_classifier` and `text_embedder`
handlers share.

The archive packs a Hugging Face `tokenizers` tokenizer as `tokenizer.json` (`--extra-files`).
A request brings its texts as a BYTES tensor (Open Inference Protocol: one text per element), as
a `/predictions` body (plain text; or JSON: a string, a list of strings, or an object whose
`text`, `inputs` or `data` holds one of those) or already tokenized as an `input_ids` tensor of
integers (the tokenizer's ids; `attention_mask` optional). Each text is one row.

The rows of a batch are grouped by length: sorted, cut where the next row would more than
double its group's padding, and in parts of at most the model's batch bound. Each group is
padded to its own longest row, so a short text never pays for a long one; a model exported with
a fixed sequence length (the signature's dim 1) gets every row padded or cut to it. Texts
longer than the model takes are cut to its length (`truncated` counts them).

The model's inputs are named as Hugging Face names them: `input_ids`, `attention_mask` and
`token_type_ids` (a model of one input gets the ids, whatever its name).

    rows = TokenRows.encode(tokenizer, ["a short text", "a longer one ..."], 128)
    for group, feed in tokenized.batches(rows, input_specs, max_batch=64): ...
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
)
from scriptserve.handlers.runtime.signature import TensorSpec, numpy_dtype

log = logging.getLogger("scriptserve.handlers.text")

TOKENIZER_FILE = "tokenizer.json"
TEXT_KEYS = ("text", "inputs", "data", "input")
"""Keys of a JSON `/predictions` body that may hold the text(s)."""
_KNOWN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
_PADDING_GROWTH = 2.0
"""A group of rows ends where the next row is more than this many times its shortest row."""


class BadText(ValueError):
    """A request whose text cannot be used; it fails alone with 400."""


@dataclass(frozen=True)
class Row:
    """One text as token ids, and which request it belongs to."""

    request: int
    ids: tuple[int, ...]
    type_ids: tuple[int, ...]
    truncated: bool = False


class TextTokenizer:
    """The archive's `tokenizer.json`, cutting texts to at most `max_length` tokens."""

    def __init__(self, model_dir: Path, max_length: int | None, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise HandlerError(
                f"the archive has no {TOKENIZER_FILE}: pack the model's Hugging Face tokenizer "
                f"with --extra-files {TOKENIZER_FILE}"
            )
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise HandlerError(f"the archive's {TOKENIZER_FILE} does not load: {exc}") from None
        own = (self._tokenizer.truncation or {}).get("max_length")
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        limits = [n for n in (max_length, own, config.get("max_length")) if isinstance(n, int)]
        self.max_length = min(limits) if limits else None
        self.pad_id = _pad_id(self._tokenizer, config)
        self.vocabulary = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def rows(self, request: int, texts: Sequence[str]) -> list[Row]:
        encodings = self._tokenizer.encode_batch(list(texts))
        limit = self.max_length
        rows = []
        for encoding in encodings:
            ids, types = encoding.ids, encoding.type_ids
            cut = limit is not None and len(ids) > limit
            if limit is not None and cut:
                # Keep the closing special token ([SEP], </s>) that the template put last.
                last = ids[-1] if encoding.special_tokens_mask[-1] else None
                ids = ids[:limit] if last is None else [*ids[: limit - 1], last]
                types = types[:limit]
            rows.append(Row(request, tuple(ids), tuple(types), cut))
        return rows

    def id_rows(self, request: int, ids: np.ndarray, mask: np.ndarray | None) -> list[Row]:
        """Rows of token ids a client sent (padding, where `mask` is 0, dropped)."""
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise BadText("input_ids must be integers shaped [rows, tokens]")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocabulary):
            raise BadText(f"token ids must be in 0..{self.vocabulary - 1} (the tokenizer's)")
        if mask is not None and mask.shape != ids.shape:
            raise BadText("attention_mask must have the shape of input_ids")
        rows = []
        for i, row in enumerate(ids):
            kept = row if mask is None else row[mask[i] != 0]
            if not kept.size:
                raise BadText("a row of input_ids holds no tokens")
            if self.max_length is not None and kept.size > self.max_length:
                raise BadText(
                    f"a row of input_ids has {kept.size} tokens; the model takes at most "
                    f"{self.max_length}"
                )
            values = tuple(int(t) for t in kept)
            rows.append(Row(request, values, (0,) * len(values)))
        return rows


def _pad_id(tokenizer: Any, config: dict[str, Any]) -> int:
    """The padding token: the model config's `pad_token_id`, the tokenizer's padding or its
    [PAD]/<pad> token, else 0."""
    configured = config.get("pad_token_id")
    if isinstance(configured, int) and not isinstance(configured, bool):
        return configured
    padding = getattr(tokenizer, "padding", None)
    if isinstance(padding, dict) and isinstance(padding.get("pad_id"), int):
        return int(padding["pad_id"])
    for token in ("[PAD]", "<pad>", "<|pad|>"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0


def request_texts(request: InferenceRequest) -> list[str] | tuple[np.ndarray, np.ndarray | None]:
    """The texts of one request, or its token ids (and attention mask) when it sent those;
    BadText saying what to send otherwise."""
    if request.inputs:
        ids = request.inputs.get("input_ids")
        if ids is not None:
            return ids, request.inputs.get("attention_mask")
        texts = [a for a in request.inputs.values() if a.dtype == np.object_]
        if len(texts) != 1 or len(request.inputs) != 1:
            raise BadText("send the text as one BYTES tensor (one text per element)")
        return [_text(value) for value in texts[0].reshape(-1)]
    body = request.body
    if not body:
        raise BadText("the request has no text; send it as the body (text/plain or JSON)")
    content_type = (request.content_type or "").lower()
    looks_json = body.lstrip()[:1] in (b"[", b"{", b'"')
    if "json" in content_type or (looks_json and "text/plain" not in content_type):
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if "json" in content_type:
                raise BadText(f"the body is not valid JSON: {exc}") from None
            return [_text(body)]
        return _texts_of(doc)
    return [_text(body)]


def _texts_of(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        key = next((k for k in TEXT_KEYS if k in doc), None)
        if key is None:
            raise BadText(f"a JSON body needs the text under one of {', '.join(TEXT_KEYS)}")
        doc = doc[key]
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, list) and doc and all(isinstance(t, str) for t in doc):
        return list(doc)
    raise BadText("send a text, or a non-empty list of texts, as JSON strings")


def _text(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise BadText("the text is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise BadText("send the text as a string")


def check_inputs(specs: Sequence[TensorSpec]) -> None:
    """Refuse a model whose inputs a tokenizer cannot fill, at load."""
    if len(specs) == 1:
        return
    unknown = [s.name for s in specs if s.name not in _KNOWN_INPUTS]
    if unknown or "input_ids" not in {s.name for s in specs}:
        raise HandlerError(
            f"the model takes {', '.join(s.name for s in specs)}; a text handler fills "
            f"{', '.join(_KNOWN_INPUTS)} (or a model of one input with the ids)"
        )


def fixed_length(specs: Sequence[TensorSpec]) -> int | None:
    """The sequence length of a model exported for one (dim 1 of its inputs); None when any
    length is taken."""
    sizes = {s.shape[1] for s in specs if len(s.shape) > 1}
    return next(iter(sizes)) if len(sizes) == 1 and -1 not in sizes else None


def groups(rows: Sequence[Row], max_batch: int | None) -> Iterator[list[int]]:
    """Indices of `rows` in groups of similar length: sorted by length, a new group where the
    next row is more than twice as long as its group's shortest, or the group is full."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
    group: list[int] = []
    for i in order:
        length = len(rows[i].ids)
        full = max_batch is not None and len(group) >= max_batch
        if group and (full or length > _PADDING_GROWTH * len(rows[group[0]].ids)):
            yield group
            group = []
        group.append(i)
    if group:
        yield group


def feed(
    rows: Sequence[Row], specs: Sequence[TensorSpec], pad_id: int, length: int | None = None
) -> dict[str, np.ndarray]:
    """The model's inputs for `rows`, padded to `length` (default: the longest row)."""
    width = length or max(len(r.ids) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    types = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        n = min(len(row.ids), width)
        ids[i, :n] = row.ids[:n]
        mask[i, :n] = 1
        types[i, :n] = row.type_ids[:n]
    by_name = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    if len(specs) == 1:
        return {specs[0].name: ids.astype(numpy_dtype(specs[0].datatype), copy=False)}
    return {s.name: by_name[s.name].astype(numpy_dtype(s.datatype), copy=False) for s in specs}


@dataclass
class TextBatch:
    """A batch's rows, which request each came from, the model's answer per row, and the
    requests that failed."""

    size: int
    rows: list[Row]
    errors: dict[int, InferenceResponse]
    outputs: list[np.ndarray | None]
    """One array per row (what the handler keeps of the model's outputs for it)."""
    parameters: list[dict[str, Any]]
    """Each request's parameters."""


class TextHandler(BaseHandler):
    """Tokenizes each request's texts, runs its rows in groups of similar length, and hands
    each row's outputs to `row_outputs`; subclasses answer in `postprocess`."""

    thread_safe = True  # per-batch state lives in TextBatch, never on self

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        self.specs = tuple(
            context.signature.inputs
            or (TensorSpec(n, "INT64", (-1, -1)) for n in self.model.input_names)
        )
        check_inputs(self.specs)
        self.fixed_length = fixed_length(self.specs)
        bound = self.fixed_length or getattr(self.model, "max_seq_len", None)
        self.tokenizer = TextTokenizer(context.model_dir, bound, context.model_config)
        self.max_batch: int | None = getattr(self.model, "max_batch", None)

    def _rows(self, index: int, request: InferenceRequest) -> list[Row]:
        found = request_texts(request)
        if isinstance(found, list):
            return self.tokenizer.rows(index, found)
        ids, mask = found
        return self.tokenizer.id_rows(index, ids, mask)

    def preprocess(self, requests: list[InferenceRequest]) -> TextBatch:
        batch = TextBatch(len(requests), [], {}, [], [dict(r.parameters) for r in requests])
        for index, request in enumerate(requests):
            try:
                batch.rows += self._rows(index, request)
            except BadText as exc:
                log.info("model %s request %s: %s", self._model_name(), request.request_id, exc)
                batch.errors[index] = InferenceResponse.failed(str(exc), 400)
        batch.outputs = [None] * len(batch.rows)
        return batch

    def _model_name(self) -> str:
        return self.context.model_name if self.context else "?"

    def inference(self, batch: TextBatch) -> TextBatch:
        for group in groups(batch.rows, self.max_batch):
            rows = [batch.rows[i] for i in group]
            inputs = feed(rows, self.specs, self.tokenizer.pad_id, self.fixed_length)
            try:
                outputs = self.model.run(inputs)
            except BackendError as exc:
                for row in rows:
                    batch.errors[row.request] = InferenceResponse.failed(str(exc), exc.status)
                continue
            kept = self.row_outputs(outputs, inputs)
            for i, value in zip(group, kept, strict=True):
                batch.outputs[i] = value
        return batch

    def row_outputs(
        self, outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray]
    ) -> Sequence[np.ndarray]:
        """What to keep of the model's outputs for each row of a group."""
        raise NotImplementedError

    def request_rows(self, batch: TextBatch) -> dict[int, list[tuple[Row, np.ndarray]]]:
        """Each answered request's rows with their outputs, in the order it sent them."""
        found: dict[int, list[tuple[Row, np.ndarray]]] = {}
        for row, value in zip(batch.rows, batch.outputs, strict=True):
            if row.request not in batch.errors and value is not None:
                found.setdefault(row.request, []).append((row, value))
        return found
