"""The built-in `text_generator` on the zoo's GPT-2 (small, a byte-level BPE tokenizer packed in
the archive, the sequence exported dynamic), as a `.pt2`, TorchScript and ONNX archive: each
prompt's streamed answer is the eager model's greedy continuation, decoded by the tokenizer,
whatever else shares its batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from zoo_archives import ZooStore, archive_as, zoo_greedy, zoo_reference

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.backends import load_backend
from scriptserve.handlers.base import Context, InferenceRequest, InferenceResponse
from scriptserve.handlers.loader import load_handler, read_model_config
from scriptserve.handlers.text_generator import TextGenerator

# Slow: the zoo's models, built and compiled for the session.
pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "a dog and a cat are happy and the music is good"]


@pytest.fixture(scope="module")
def generator(zoo: ZooStore) -> Iterator[TextGenerator]:
    yield from generator_of(zoo.archive("gpt2"))


def generator_of(archive: Path) -> Iterator[TextGenerator]:
    with open_archive(archive) as reader:
        manifest = reader.manifest
        config = read_model_config(reader.root, manifest)
        context = Context("gpt2", "1.0", reader.root, manifest, config)
        handler = load_handler(context)
        assert isinstance(handler, TextGenerator)
        yield handler


def answers(generator: TextGenerator, *requests: InferenceRequest) -> list[list[InferenceResponse]]:
    """Each request's parts, in order."""
    parts: list[list[InferenceResponse]] = [[] for _ in requests]
    for step in generator.stream(list(requests)):
        for i, part in enumerate(step):
            if part is not None:
                parts[i].append(part)
    return parts


def assert_generates_greedily(zoo: ZooStore, archive: Path, tokens: int = 8) -> None:
    """Each prompt, batched beside the other, streams the eager fp32 model's greedy
    continuation when `archive` serves it."""
    requests = [
        InferenceRequest(body=p.encode(), parameters={"max_tokens": tokens}) for p in PROMPTS
    ]
    for handler in generator_of(archive):
        for prompt, parts in zip(PROMPTS, answers(handler, *requests), strict=True):
            assert all(p.error is None for p in parts), [p.error for p in parts]
            text = b"".join(p.body for p in parts).decode()
            assert text == zoo_greedy(zoo.model("gpt2"), prompt, tokens)


def test_each_prompt_streams_the_models_greedy_continuation(
    zoo: ZooStore, generator: TextGenerator
) -> None:
    requests = [InferenceRequest(body=p.encode(), parameters={"max_tokens": 12}) for p in PROMPTS]

    for prompt, parts in zip(PROMPTS, answers(generator, *requests), strict=True):
        assert all(p.error is None for p in parts), [p.error for p in parts]
        assert parts[-1].final and not any(p.final for p in parts[:-1])
        text = b"".join(p.body for p in parts).decode()
        assert text == zoo_greedy(zoo.model("gpt2"), prompt, 12)
        assert len(parts) <= 12


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_torchscript_and_onnx_archives_give_the_eager_logits_and_generate_alike(
    zoo: ZooStore, fmt: str, tmp_path: Path
) -> None:
    """GPT-2 traced to TorchScript and exported to ONNX (batch and sequence dynamic), archived
    with the same tokenizer and handler: the next-token logits of padded rows are the eager
    model's, and each prompt, alone and batched beside a longer one, streams the eager model's
    greedy continuation."""
    built = zoo.model("gpt2")
    archive = archive_as(built, fmt, tmp_path)
    with np.load(built.validation) as data:
        rows = {n: data[n][:3] for n in data.files}
    with open_archive(archive) as reader:
        manifest = reader.manifest
        path = reader.root / manifest.model.serialized_file  # type: ignore[operator]
        logits = load_backend(path, manifest.model_format, manifest=manifest).run(rows)
    np.testing.assert_allclose(next(iter(logits.values())), zoo_reference(built, rows), atol=1e-4)

    assert_generates_greedily(zoo, archive)


def test_a_dynamic_int8_archive_runs_int8_kernels_and_generates_as_fp32_does(
    zoo: ZooStore,
) -> None:
    """GPT-2 with dynamic int8 linear layers (sequence still dynamic): the accuracy guard held
    its next-token choice to fp32's on the validation texts, and each prompt's greedy
    continuation streams as the fp32 model's does."""
    archive = zoo.archive("gpt2", "dynamic-int8")
    with open_archive(archive) as reader:
        assert reader.manifest.scriptserve is not None
        quantization = reader.manifest.scriptserve.quantization
        pt2 = reader.manifest.scriptserve.pt2
    assert quantization.mode == "dynamic-int8"
    assert any("qlinear" in k for k in quantization.details["quantizedOps"])
    validation = quantization.details["validation"]
    assert validation["top1_agreement"] >= 0.99 and validation["min_cosine"] >= 0.99
    assert pt2 is not None and pt2.max_seq_len == 64

    assert_generates_greedily(zoo, archive)


def test_a_prompt_answers_alike_alone_and_padded_beside_a_longer_one(
    generator: TextGenerator,
) -> None:
    short = InferenceRequest(body=PROMPTS[0].encode(), parameters={"max_tokens": 8})
    long = InferenceRequest(body=PROMPTS[1].encode(), parameters={"max_tokens": 8})
    (alone,) = answers(generator, short)
    together, _ = answers(generator, short, long)

    assert [p.body for p in together] == [p.body for p in alone]


def test_a_bad_prompt_fails_alone(generator: TextGenerator) -> None:
    bad, good = answers(
        generator,
        InferenceRequest(body=b"\xff\xfe", content_type="text/plain"),
        InferenceRequest(body=b"a dog", parameters={"max_tokens": 2}),
    )

    assert bad[0].status == 400 and "UTF-8" in (bad[0].error or "")
    assert good and good[-1].final and all(p.error is None for p in good)
