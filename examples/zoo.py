"""The model zoo: Hugging Face models as people deploy them, built from their configs with
seeded random weights (no model hub is needed), for the examples, the tests and
`python -m benchmarks.zoo`.

Each model has a folder here with its `model.py` (the class model-archiver exports, built from
the `config.json` beside it) and a README of the commands from model to served answer. `build`
writes what a user would have after downloading the model: the class and its config, the state
dict, the tokenizer (text models), a sample input and validation samples. `size="full"` is the
published architecture; `size="small"` a model of the same layout small enough for the tests.

    built = build("bert", Path("build/zoo/bert"), size="small")
    model_archiver_main(built.archiver_args("bert", "model_store"))

    python -m examples.zoo bert build/zoo/bert [--size full]
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EXAMPLES = Path(__file__).resolve().parent
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "an",
    "be",
    "this",
    "are",
    "or",
    "which",
    "his",
    "her",
    "their",
    "has",
    "have",
    "had",
    "not",
    "but",
    "were",
    "all",
    "one",
    "new",
    "first",
    "also",
    "after",
    "when",
    "more",
    "who",
    "can",
    "two",
    "year",
    "years",
    "time",
    "over",
    "into",
    "than",
    "most",
    "only",
    "other",
    "its",
    "some",
    "these",
    "may",
    "such",
    "about",
    "people",
    "would",
    "up",
    "out",
    "so",
    "what",
    "there",
    "no",
    "then",
    "them",
    "he",
    "she",
    "they",
    "we",
    "you",
    "i",
    "my",
    "your",
    "our",
    "model",
    "models",
    "serve",
    "served",
    "serving",
    "fast",
    "safe",
    "text",
    "image",
    "images",
    "cat",
    "cats",
    "dog",
    "dogs",
    "bird",
    "car",
    "house",
    "tree",
    "good",
    "bad",
    "great",
    "small",
    "large",
    "red",
    "blue",
    "green",
    "black",
    "white",
    "happy",
    "sad",
    "quick",
    "brown",
    "fox",
    "jumps",
    "lazy",
    "day",
    "night",
    "water",
    "fire",
    "city",
    "world",
    "music",
    "film",
    "book",
    "song",
    "game",
    "team",
    "school",
    "work",
    "home",
    "love",
    "life",
    "family",
    "friend",
    "word",
    "words",
    "sentence",
    "sentences",
    "question",
    "answer",
    "search",
    "document",
]
SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog."
END_OF_TEXT = "<|endoftext|>"
VALIDATION_TEXTS = 64


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: its folder, class, handler and configs at both sizes."""

    name: str
    model_class: str
    config_class: str
    handler: str
    kind: str
    """"image" or "text"."""
    full: dict[str, Any]
    small: dict[str, Any]
    quantize: tuple[str, ...] = ("dynamic-int8",)
    """The int8 modes the model has."""


ZOO: dict[str, ZooModel] = {
    "resnet50": ZooModel(
        "resnet50", "ResNet50", "ResNetConfig", "image_classifier", "image",
        full={"num_labels": 1000},
        small={"embedding_size": 16, "hidden_sizes": [32, 64, 64, 128], "depths": [1, 1, 1, 1],
               "num_labels": 10, "image_size": 32},
        quantize=("static-int8",),
    ),
    "vit": ZooModel(
        "vit", "ViT", "ViTConfig", "image_classifier", "image",
        full={"num_labels": 1000},
        small={"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "intermediate_size": 64, "num_labels": 10},
        quantize=("dynamic-int8", "static-int8"),
    ),
    "bert": ZooModel(
        "bert", "BertClassifier", "BertConfig", "text_classifier", "text",
        full={"num_labels": 2},
        small={"vocab_size": 400, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 64, "num_labels": 3},
    ),
    "gpt2": ZooModel(
        "gpt2", "GPT2NextToken", "GPT2Config", "text_generator", "text",
        # The zoo's tokenizer puts <|endoftext|> first; a real GPT-2 checkpoint's is 50256.
        full={"bos_token_id": 0, "eos_token_id": 0},
        small={"vocab_size": 300, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2,
               "bos_token_id": 0, "eos_token_id": 0},
    ),
    "embedder": ZooModel(
        "embedder", "SentenceEmbedder", "BertConfig", "text_embedder", "text",
        full={"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
              "intermediate_size": 1536},
        small={"vocab_size": 400, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 64},
    ),
}  # fmt: skip


@dataclass
class Built:
    """What `build` wrote: the files model-archiver takes."""

    model: ZooModel
    root: Path
    model_file: Path
    weights: Path
    validation: Path
    sample: Path | None = None
    image_size: int | None = None
    extra_files: list[Path] = field(default_factory=list)

    def archiver_args(self, name: str, export_path: Path, *extra: str) -> list[str]:
        """model-archiver's arguments for a `.pt2` archive of this model (add `--quantize`)."""
        args = [
            "--model-name", name, "--version", "1.0", "--export-pt2",
            "--model-file", str(self.model_file), "--model-class", self.model.model_class,
            "--serialized-file", str(self.weights), "--handler", self.model.handler,
            "--validation-file", str(self.validation), "--export-path", str(export_path), "-f",
        ]  # fmt: skip
        if self.sample is not None:
            args += ["--sample-input", str(self.sample)]
        else:
            args += ["--input-shape", f"pixel_values=3,{self.image_size},{self.image_size}"]
        if self.extra_files:
            args += ["--extra-files", ",".join(str(p) for p in self.extra_files)]
        return [*args, *extra]


def built_in(name: str, root: Path) -> Built:
    """What `build` wrote into `root` for the zoo model `name`, read back from its files."""
    model = ZOO[name]
    built = Built(model, root, root / "model.py", root / "weights.pt", root / "validation.npz")
    built.extra_files.append(root / "config.json")
    if model.kind == "image":
        config = json.loads((root / "config.json").read_text())
        built.image_size = int(config.get("image_size", 224))
    else:
        built.sample = root / "sample.json"
        built.extra_files.append(root / "tokenizer.json")
    return built


def wordpiece_tokenizer(vocab_size: int) -> Any:
    """A BERT-style WordPiece tokenizer (lower-cased, [CLS] text [SEP]) over at most
    `vocab_size` tokens: the special tokens, characters, word pieces and common words."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = [*SPECIAL_TOKENS]
    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()"
    pieces += list(chars) + [f"##{c}" for c in chars if c.isalnum()]
    pieces += [w for w in WORDS if w not in pieces]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(pieces[:vocab_size]))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def byte_level_tokenizer(vocab_size: int) -> Any:
    """A GPT-2-style byte-level BPE tokenizer of at most `vocab_size` tokens (its 256 bytes,
    merges learnt from the zoo's words, and `<|endoftext|>`, which ends a generation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [SAMPLE_TEXT, " ".join(WORDS), *validation_texts(256, seed=1)]
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def validation_texts(count: int, seed: int = 0) -> list[str]:
    """Sentences of 4 to 24 words, seeded."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 25)))) for _ in range(count)]


@dataclass(frozen=True)
class Continuation:
    """A generator's greedy continuation of a prompt."""

    text: str
    tokens: int
    ended: bool
    """It stopped at the tokenizer's end-of-text token, before the tokens asked for."""


def greedy_continuation(built: Built, model: Any, prompt: str, tokens: int) -> Continuation:
    """`model`'s (the eager generator's) greedy continuation of `prompt`, at most `tokens`
    tokens: one call per token over the whole context (no key/value cache), decoded by its
    tokenizer. The reference a served generator's answer is held against."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(built.root / "tokenizer.json"))
    end = tokenizer.token_to_id("<|endoftext|>")
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    start = len(ids)
    for _ in range(tokens):
        with torch.no_grad():
            x = torch.tensor([ids])
            token = int(model(input_ids=x, attention_mask=torch.ones_like(x)).argmax(-1))
        if token == end:
            return Continuation(str(tokenizer.decode(ids[start:])), len(ids) - start, True)
        ids.append(token)
    return Continuation(str(tokenizer.decode(ids[start:])), len(ids) - start, False)


def _config(model: ZooModel, size: str) -> Any:
    import transformers

    kwargs = model.full if size == "full" else model.small
    return getattr(transformers, model.config_class)(**kwargs)


def build(name: str, dst: Path, size: str = "small", seed: int = 0) -> Built:
    """Write the zoo model `name` into `dst`, its weights seeded with `seed`."""
    import torch

    model = ZOO[name]
    dst.mkdir(parents=True, exist_ok=True)
    model_file = dst / "model.py"
    shutil.copyfile(EXAMPLES / model.name / "model.py", model_file)
    config = _config(model, size)
    config.to_json_file(str(dst / "config.json"))
    namespace: dict[str, Any] = {"__file__": str(model_file), "__name__": f"zoo_{name}"}
    exec(compile(model_file.read_text(), str(model_file), "exec"), namespace)
    torch.manual_seed(seed)
    module = namespace[model.model_class]().eval()
    # config.json goes into the archive too: the handlers read its id2label.
    built = Built(model, dst, model_file, dst / "weights.pt", dst / "validation.npz")
    built.extra_files.append(dst / "config.json")
    rng = np.random.default_rng(seed)
    if model.kind == "image":
        built.image_size = int(getattr(config, "image_size", 224))
        side = built.image_size
        templates = rng.integers(0, 256, (IMAGE_CLASSES, 4, 4, 3))
        inputs = {"pixel_values": task_images(rng, templates, VALIDATION_IMAGES, side)[0]}
        # Trained on images of its own, never the validation ones.
        train = np.random.default_rng(seed + 1)
        images, labels = task_images(train, templates, TRAINING_IMAGES, side)
        fitted_head(module, {"pixel_values": images}, labels % int(config.num_labels))
    else:
        positions = getattr(config, "n_positions", None) or config.max_position_embeddings
        inputs = _text_files(built, name, int(config.vocab_size), int(positions), seed)
        if model.handler.endswith("classifier"):
            decisive_head(module, inputs)
    np.savez(built.validation, **inputs)
    torch.save(module.state_dict(), built.weights)
    return built


IMAGE_CLASSES = 8
"""Classes of the image task a zoo image classifier's head is fitted to (`fitted_head`)."""
VALIDATION_IMAGES = 32
TRAINING_IMAGES = 64
CLASS_SPREAD = 24
"""How far (in grey levels) an image's coarse colours stray from its class's template."""


def task_images(
    rng: np.random.Generator, templates: np.ndarray, count: int, side: int
) -> tuple[np.ndarray, np.ndarray]:
    """`count` images of a small task, normalised as an ImageNet model sees them
    ([count, 3, side, side]), and their classes, in turn: each a class's coarse 4x4 colour
    template (`templates`, [classes, 4, 4, 3]) with colours of its own within CLASS_SPREAD,
    upsampled into smooth colour fields, as neighbouring pixels of a photo are alike. Pixel-wise
    noise would drive a convolutional model to activations no photo gives."""
    from PIL import Image

    labels = np.arange(count) % len(templates)
    strays = rng.integers(-CLASS_SPREAD, CLASS_SPREAD + 1, (count, 4, 4, 3))
    coarse = np.clip(templates[labels] + strays, 0, 255).astype(np.uint8)
    images = [
        np.asarray(Image.fromarray(c).resize((side, side), Image.Resampling.BICUBIC), np.float32)
        for c in coarse
    ]
    pixels = np.stack(images).transpose(0, 3, 1, 2) / 255.0
    mean = np.array(IMAGENET_MEAN, np.float32).reshape(1, 3, 1, 1)
    std = np.array(IMAGENET_STD, np.float32).reshape(1, 3, 1, 1)
    return ((pixels - mean) / std).astype(np.float32), labels


HEAD_STEPS = 500


def fitted_head(module: Any, inputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    """Fit a random image classifier's last linear layer to `labels` on `inputs` (the body's
    weights stay random, as a linear probe leaves them); returns the final training loss.

    A random head leaves the top classes within a hair of each other: on the full ViT-B/16,
    two of 32 validation images had their best two classes 0.027 and 0.197 apart (logits of
    standard deviation 4), and dynamic int8, whose logits kept a cosine of 0.999 with fp32's
    on every image, flipped exactly those. Agreement with fp32 would then measure ties, not
    quantization; a head fitted to a task decides as a trained model does."""
    import torch

    head = [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1]
    features: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, given, _out: features.append(given[0]))
    try:
        with torch.no_grad():
            for start in range(0, len(labels), 16):
                module(**{n: torch.from_numpy(a[start : start + 16]) for n, a in inputs.items()})
    finally:
        hook.remove()
    x = torch.cat(features)
    target = torch.from_numpy(labels).long()
    optimiser = torch.optim.Adam(head.parameters(), lr=1e-2)
    loss = torch.zeros(())
    for _ in range(HEAD_STEPS):
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x), target)
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
    head.zero_grad(set_to_none=True)
    return float(loss.detach())


def _text_files(
    built: Built, name: str, vocab_size: int, positions: int, seed: int
) -> dict[str, np.ndarray]:
    """Write the tokenizer and the sample; return the validation texts as padded token ids, at
    most the model's `positions` long (a generator keeps each text's end: it continues it)."""
    dst = built.root
    generator = name == "gpt2"
    tokenizer = byte_level_tokenizer(vocab_size) if generator else wordpiece_tokenizer(vocab_size)
    tokenizer.save(str(dst / "tokenizer.json"))
    built.extra_files.append(dst / "tokenizer.json")
    inputs = ["input_ids", "attention_mask", "token_type_ids"]
    if name in ("embedder", "gpt2"):
        inputs = inputs[:2]
    encoding = tokenizer.encode(SAMPLE_TEXT)
    values = {
        "input_ids": encoding.ids,
        "attention_mask": encoding.attention_mask,
        "token_type_ids": encoding.type_ids,
    }
    built.sample = dst / "sample.json"
    built.sample.write_text(json.dumps({n: values[n] for n in inputs}))
    pad = END_OF_TEXT if generator else "[PAD]"
    tokenizer.enable_padding(
        pad_id=tokenizer.token_to_id(pad), pad_token=pad, direction="left" if generator else "right"
    )
    tokenizer.enable_truncation(positions, direction="left" if generator else "right")
    encodings = tokenizer.encode_batch(validation_texts(VALIDATION_TEXTS, seed))
    columns = {
        "input_ids": [e.ids for e in encodings],
        "attention_mask": [e.attention_mask for e in encodings],
        "token_type_ids": [e.type_ids for e in encodings],
    }
    return {n: np.array(columns[n], dtype=np.int64) for n in inputs}


HEAD_SPREAD = 4.0
"""The standard deviation of a classifier's logits across its classes, once its head is scaled."""


def decisive_head(module: Any, inputs: dict[str, np.ndarray]) -> float:
    """Scale a random text classifier's last linear layer so that its logits spread across classes
    as a trained model's do (standard deviation HEAD_SPREAD on the validation samples); returns
    the factor. A random head leaves the classes within a hair of each other, where any
    rounding (int8's, or another kernel's) flips the top class: agreement with fp32 would then
    measure ties, not quantization."""
    import torch

    head = [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        logits = module(**{n: torch.from_numpy(a) for n, a in inputs.items()})
        factor = HEAD_SPREAD / float(logits.std(dim=1).mean())
        head.weight.mul_(factor)
        if head.bias is not None:
            head.bias.mul_(factor)
    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a zoo model's files, ready to archive.")
    parser.add_argument("model", choices=sorted(ZOO))
    parser.add_argument("dst", type=Path)
    parser.add_argument("--size", choices=["full", "small"], default="full")
    args = parser.parse_args()
    built = build(args.model, args.dst, args.size)
    print(" ".join(built.archiver_args(args.model, Path("model_store"))))


if __name__ == "__main__":
    main()
