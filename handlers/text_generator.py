"""TextGenerator: greedy text generation, streamed a token at a time (builtin `text_generator`).

Two kinds of model, as the archive says:
- A next-token model over bytes: it takes a window of token ids (`[batch, window]` int64, the
  last `window` bytes of the text so far, zero-padded on the left) and returns logits over the
  256 byte values for the next one (`[batch, 256]`), as a TorchScript, `.pt2` or ONNX file. The
  window is the archive's recorded input width, or the model config's `window`.
- A Hugging Face causal language model whose archive packs its `tokenizer.json` (GPT-2 and its
  kind, examples/gpt2): it takes left-padded `input_ids` and their `attention_mask` ([batch,
  seq]) and returns the next token's logits ([batch, vocabulary]). Its window is the sequence
  bound it was exported with (`--max-seq-len`, else the config's `n_positions`): the text so far
  is cut to its last `window` tokens. A generation ends at `max_tokens` or at the tokenizer's
  end-of-text token (the model config's `eos_token_id`, else `<|endoftext|>` or `</s>`).

A request brings its prompt as the `text_input` tensor (Open Inference Protocol, Triton's
generate), as a JSON body `{"text_input": "...", "max_tokens": 8}` (application/json, or any
body without a content type that reads as one, as gRPC's `input` fields) or as plain text
(`/predictions`); `max_tokens` (a request parameter, or in the JSON body) bounds its answer,
at most the model config's `max_tokens` (default 64). Requests of one batch generate together,
one model call per step for all of them; each gets a part per token, the token's text as both
the `text_output` tensor and the body (a character split across tokens comes with its last
one), and its last token is its final part.
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
from scriptserve.handlers.tokenized import TOKENIZER_FILE

VOCABULARY = 256
_INCOMPLETE = "\ufffd".encode()
"""What a tokenizer decodes the first bytes of a character split across tokens to."""
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


class _Bytes:
    """The next-byte model's vocabulary: a token is a byte."""

    eos: int | None = None

    def __init__(self, input_name: str, window: int) -> None:
        self.input_name = input_name
        self.window = window
        self.size = VOCABULARY

    def encode(self, text: bytes) -> list[int]:
        return list(text)

    def feed(self, texts: list[list[int]]) -> dict[str, np.ndarray]:
        batch = np.zeros((len(texts), self.window), dtype=np.int64)
        for row, tokens in enumerate(texts):
            tail = tokens[-self.window :]
            batch[row, self.window - len(tail) :] = tail
        return {self.input_name: batch}

    def text(self, tokens: list[int]) -> bytes:
        return bytes(tokens)


class _Tokenizer:
    """A Hugging Face tokenizer's vocabulary, fed to the model left-padded with a mask."""

    def __init__(self, context: Context, names: tuple[str, ...], window: int) -> None:
        from tokenizers import Tokenizer

        path = context.model_dir / TOKENIZER_FILE
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise HandlerError(f"the archive's {TOKENIZER_FILE} does not load: {exc}") from None
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        if "input_ids" not in names or not set(names) <= {"input_ids", "attention_mask"}:
            raise HandlerError(
                f"the model takes {', '.join(names)}; a generator with a tokenizer takes "
                "input_ids and attention_mask"
            )
        self.names = names
        self.window = window
        self.size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos = _end_of_text(self._tokenizer, context.model_config)
        self.pad = self.eos if self.eos is not None else 0

    def encode(self, text: bytes) -> list[int]:
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            raise HandlerError("the prompt is not valid UTF-8", 400) from None
        return list(self._tokenizer.encode(decoded, add_special_tokens=False).ids)

    def feed(self, texts: list[list[int]]) -> dict[str, np.ndarray]:
        width = min(self.window, max(len(t) for t in texts))
        ids = np.full((len(texts), width), self.pad, dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for row, tokens in enumerate(texts):
            tail = tokens[-width:]
            ids[row, width - len(tail) :] = tail
            mask[row, width - len(tail) :] = 1
        both = {"input_ids": ids, "attention_mask": mask}
        return {name: both[name] for name in self.names}

    def text(self, tokens: list[int]) -> bytes:
        return self._tokenizer.decode(tokens, skip_special_tokens=True).encode()


def _end_of_text(tokenizer: Any, config: dict[str, Any]) -> int | None:
    configured = config.get("eos_token_id")
    if isinstance(configured, int) and not isinstance(configured, bool):
        return configured
    for token in ("<|endoftext|>", "</s>", "<eos>"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
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
        bound = getattr(self.model, "max_seq_len", None)
        window = config.get("window", width if width and width > 0 else bound)
        if window is None:
            raise HandlerError(
                "the model's window is unknown: archive it with a sample input of token ids, "
                "or set `window` in its model config"
            )
        self.window = _positive_int(window, "window")
        self.vocabulary: _Bytes | _Tokenizer = (
            _Tokenizer(context, tuple(self.model.input_names), self.window)
            if (context.model_dir / TOKENIZER_FILE).is_file()
            else _Bytes(self.input_name, self.window)
        )

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
            tokens = self.vocabulary.encode(text)
        size = self.vocabulary.size
        if not tokens or any(not 0 <= t < size for t in tokens):
            raise HandlerError(f"send a prompt of token ids in 0..{size - 1}", 400)
        max_tokens = _positive_int(limit, "max_tokens")
        if max_tokens > self.max_tokens:
            raise HandlerError(
                f"max_tokens {max_tokens} is more than this model generates ({self.max_tokens})",
                400,
            )
        return _Prompt(tokens, max_tokens)

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
        starts = [len(tokens) for tokens in texts]
        sent = [0] * len(requests)
        """Bytes of each answer sent so far."""
        vocabulary = self.vocabulary
        for step in range(max(limits)):
            active = [i for i, limit in enumerate(limits) if step < limit]
            if not active:
                return
            logits = self.model.run(vocabulary.feed([texts[i] for i in active]))
            chosen = np.asarray(next(iter(logits.values()))).argmax(axis=-1)
            parts: list[InferenceResponse | None] = [None] * len(requests)
            for i, token in zip(active, chosen.tolist(), strict=True):
                ended = vocabulary.eos is not None and int(token) == vocabulary.eos
                if ended:
                    limits[i] = step  # generates no further
                else:
                    texts[i].append(int(token))
                final = ended or step == limits[i] - 1
                piece = vocabulary.text(texts[i][starts[i] :])[sent[i] :]
                if not final and (not piece or piece.endswith(_INCOMPLETE)):
                    continue  # a character whose bytes the next tokens complete
                sent[i] += len(piece)
                parts[i] = InferenceResponse(
                    outputs={TEXT_OUTPUT: np.array([piece], dtype=object)},
                    body=piece,
                    content_type="text/plain; charset=utf-8",
                    final=final,
                )
            yield parts
