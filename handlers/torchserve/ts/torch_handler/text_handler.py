"""`ts.torch_handler.text_handler.TextHandler`: text clean-up and the source vocabulary.

`source_vocab.pt` is read with `torch.load(..., weights_only=True)`: it must hold a plain
`{token: index}` dict or a list of tokens (a pickled torchtext `Vocab` object is refused; save
`dict(vocab.get_stoi())` instead). Unknown tokens map to `<unk>` when the vocabulary has it,
else to index 0. Tokenizing is torchtext's `basic_english` (lower case, split on white space
after punctuation is removed).
"""

from __future__ import annotations

import os
import re
import string
import unicodedata
from abc import ABC
from typing import Any

import torch

from .base_handler import BaseHandler

CLEANUP_REGEX = re.compile("<.*?>")
CONTRACTION_MAP = {
    "ain't": "is not", "aren't": "are not", "can't": "cannot", "could've": "could have",
    "couldn't": "could not", "didn't": "did not", "doesn't": "does not", "don't": "do not",
    "hadn't": "had not", "hasn't": "has not", "haven't": "have not", "he'd": "he would",
    "he'll": "he will", "he's": "he is", "how's": "how is", "i'd": "i would", "i'll": "i will",
    "i'm": "i am", "i've": "i have", "isn't": "is not", "it'd": "it would", "it'll": "it will",
    "it's": "it is", "let's": "let us", "mightn't": "might not", "mustn't": "must not",
    "shan't": "shall not", "she'd": "she would", "she'll": "she will", "she's": "she is",
    "should've": "should have", "shouldn't": "should not", "that's": "that is",
    "there's": "there is", "they'd": "they would", "they'll": "they will",
    "they're": "they are", "they've": "they have", "wasn't": "was not", "we'd": "we would",
    "we'll": "we will", "we're": "we are", "we've": "we have", "weren't": "were not",
    "what's": "what is", "where's": "where is", "who's": "who is", "won't": "will not",
    "would've": "would have", "wouldn't": "would not", "you'd": "you would",
    "you'll": "you will", "you're": "you are", "you've": "you have",
}  # fmt: skip
CONTRACTIONS_PATTERN = re.compile(
    "({})".format("|".join(re.escape(k) for k in CONTRACTION_MAP)), flags=re.IGNORECASE
)


def basic_english(text: str) -> list[str]:
    """torchtext's `basic_english` tokenizer."""
    text = text.lower()
    for pattern, replacement in _BASIC_ENGLISH:
        text = pattern.sub(replacement, text)
    return text.split()


_BASIC_ENGLISH = [
    (re.compile(p), r)
    for p, r in [
        (r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "),
        (r"\(", " ( "), (r"\)", " ) "), (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "),
        (r"\:", " "), (r"\s+", " "),
    ]
]  # fmt: skip


def ngrams_iterator(tokens: list[str], ngrams: int) -> list[str]:
    """The tokens, then every run of 2..ngrams tokens joined by spaces (torchtext's order)."""
    out = list(tokens)
    for n in range(2, ngrams + 1):
        out.extend(" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return out


class SourceVocab:
    """`vocab[token]` -> index, with a default for unknown tokens."""

    def __init__(self, stoi: dict[str, int]) -> None:
        self.stoi = stoi
        self.default = stoi.get("<unk>", 0)

    def __getitem__(self, token: str) -> int:
        return self.stoi.get(token, self.default)

    def __len__(self) -> int:
        return len(self.stoi)


def load_source_vocab(path: str) -> SourceVocab:
    try:
        data = torch.load(path, weights_only=True)
    except Exception:
        raise RuntimeError(
            f"{os.path.basename(path)} is not a plain dict or list of tokens; scriptserve never "
            "unpickles objects (torch.load weights_only=True): save a torchtext vocabulary with "
            "torch.save(dict(vocab.get_stoi()), 'source_vocab.pt')"
        ) from None
    if isinstance(data, dict):
        return SourceVocab({str(k): int(v) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return SourceVocab({str(token): i for i, token in enumerate(data)})
    raise RuntimeError(f"{os.path.basename(path)} must hold a {{token: index}} dict or a list")


class TextHandler(BaseHandler, ABC):
    def __init__(self) -> None:
        super().__init__()
        self.source_vocab: SourceVocab | None = None
        self.tokenizer = basic_english

    def initialize(self, context: Any) -> None:
        super().initialize(context)
        self.initialized = False
        model = self.manifest["model"] if self.manifest else {}
        source_vocab = model.get("sourceVocab")
        if source_vocab:
            path = os.path.join(context.system_properties["model_dir"], source_vocab)
        else:
            path = self.get_source_vocab_path(context)
        self.source_vocab = load_source_vocab(path)
        self.initialized = True

    def get_source_vocab_path(self, ctx: Any) -> str:
        path = os.path.join(ctx.system_properties.get("model_dir"), "source_vocab.pt")
        if os.path.isfile(path):
            return path
        raise RuntimeError(
            "Missing the source_vocab file. Refer default handler documentation for details on "
            "using text_handler."
        )

    def _expand_contractions(self, text: str) -> str:
        def expand(match: re.Match[str]) -> str:
            found = match.group(0)
            expanded = CONTRACTION_MAP.get(found) or CONTRACTION_MAP.get(found.lower(), found)
            return found[0] + expanded[1:]

        return CONTRACTIONS_PATTERN.sub(expand, text).replace("'", "")

    def _remove_accented_characters(self, text: str) -> str:
        return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("utf-8")

    def _remove_html_tags(self, text: str) -> str:
        return CLEANUP_REGEX.sub("", text)

    def _remove_punctuation(self, text: str) -> str:
        return text.translate(str.maketrans("", "", string.punctuation))

    _remove_puncutation = _remove_punctuation  # TorchServe's spelling, kept for subclasses

    def _tokenize(self, text: str) -> list[str]:
        return self.tokenizer(text)
