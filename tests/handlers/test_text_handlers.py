"""The built-in `text_classifier` and `text_embedder` handlers on the zoo's BERT classifier and
sentence embedder, compiled to `.pt2` with a dynamic sequence: each text answers as the eager
model answers it alone, whatever the batch it is padded in; bad texts fail alone."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from zoo_archives import ZooStore, zoo_reference

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
    run_batch,
)
from scriptserve.handlers.loader import load_handler, read_model_config
from scriptserve.handlers.text_classifier import TextClassifier
from scriptserve.handlers.text_embedder import TextEmbedder

# Slow: the zoo's models, built and compiled for the session.
pytestmark = pytest.mark.slow

Loaded = tuple[BaseHandler, Context]
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog and the cat is happy",
    "a dog",
    "music film book song game team school work home love life family friend word",
]


@pytest.fixture(scope="module")
def classifier(zoo: ZooStore) -> Iterator[Loaded]:
    yield from _loaded(zoo.archive("bert"))


@pytest.fixture(scope="module")
def embedder(zoo: ZooStore) -> Iterator[Loaded]:
    yield from _loaded(zoo.archive("embedder"))


def _loaded(archive: Path) -> Iterator[Loaded]:
    with open_archive(archive) as reader:
        manifest = reader.manifest
        config = read_model_config(reader.root, manifest)
        context = Context(manifest.model.model_name, "1.0", reader.root, manifest, config)
        yield load_handler(context), context


def run(loaded: Loaded, *requests: InferenceRequest) -> list[InferenceResponse]:
    handler, context = loaded
    return run_batch(handler, list(requests), context)


def tokens(zoo: ZooStore, name: str, text: str) -> dict[str, np.ndarray]:
    """The model's inputs for one text alone, as the eager model takes them (no padding)."""
    tokenizer = Tokenizer.from_file(str(zoo.model(name).root / "tokenizer.json"))
    encoding = tokenizer.encode(text)
    inputs = {
        "input_ids": np.array([encoding.ids], np.int64),
        "attention_mask": np.array([encoding.attention_mask], np.int64),
        "token_type_ids": np.array([encoding.type_ids], np.int64),
    }
    if name == "embedder":
        del inputs["token_type_ids"]
    return inputs


def test_the_archive_takes_any_sequence_length_up_to_the_models(zoo: ZooStore) -> None:
    with open_archive(zoo.archive("bert")) as reader:
        manifest = reader.manifest
    assert [(t.name, t.datatype, t.shape) for t in manifest.signature.inputs] == [
        ("input_ids", "INT64", (-1, -1)),
        ("attention_mask", "INT64", (-1, -1)),
        ("token_type_ids", "INT64", (-1, -1)),
    ]
    assert manifest.scriptserve is not None and manifest.scriptserve.pt2 is not None
    assert manifest.scriptserve.pt2.max_seq_len == 64  # the config's max_position_embeddings


def test_each_text_of_a_batch_is_classified_as_the_model_does_it_alone(
    zoo: ZooStore, classifier: Loaded
) -> None:
    assert isinstance(classifier[0], TextClassifier)
    responses = run(classifier, *(InferenceRequest(body=t.encode()) for t in TEXTS))

    for text, response in zip(TEXTS, responses, strict=True):
        assert response.error is None, response.error
        expected = zoo_reference(zoo.model("bert"), tokens(zoo, "bert", text))
        np.testing.assert_allclose(response.outputs["logits"], expected, atol=1e-5)
        probs = np.exp(expected[0]) / np.exp(expected[0]).sum()
        best = int(np.argmax(probs))
        label = next(iter(response.body))  # most likely first; labels from config.json
        assert label == f"LABEL_{best}"
        assert response.body[label] == pytest.approx(float(probs[best]), abs=1e-5)


def test_a_request_of_several_texts_gets_a_row_each(
    classifier: Loaded,
) -> None:
    (response,) = run(
        classifier,
        InferenceRequest(body=b'{"text": ["a dog", "a cat"]}', parameters={"topk": 1}),
    )

    assert response.error is None, response.error
    assert response.outputs["logits"].shape == (2, 3)
    assert [len(answer) for answer in response.body] == [1, 1]


def test_embeddings_are_the_models_pooled_vectors_normalised(
    zoo: ZooStore, embedder: Loaded
) -> None:
    assert isinstance(embedder[0], TextEmbedder)
    # Mixed lengths in one batch: each group is padded to its own longest text.
    texts = TEXTS * 3
    responses = run(embedder, *(InferenceRequest(body=t.encode()) for t in texts))

    for text, response in zip(texts, responses, strict=True):
        assert response.error is None, response.error
        expected = zoo_reference(zoo.model("embedder"), tokens(zoo, "embedder", text))[0]
        expected = expected / np.linalg.norm(expected)
        np.testing.assert_allclose(response.body, expected, atol=1e-5)
        count = tokens(zoo, "embedder", text)["input_ids"].shape[1]
        assert response.outputs["tokens"].tolist() == [count]


def test_token_ids_answer_as_the_text_they_encode(zoo: ZooStore, embedder: Loaded) -> None:
    ids = tokens(zoo, "embedder", TEXTS[1])["input_ids"]
    padded = np.concatenate([ids, np.zeros((1, 5), np.int64)], axis=1)
    mask = (padded != 0).astype(np.int64)
    by_text, by_ids = run(
        embedder,
        InferenceRequest(inputs={"text": np.array([TEXTS[1].encode()], dtype=object)}),
        InferenceRequest(inputs={"input_ids": padded, "attention_mask": mask}),
    )

    assert by_ids.error is None, by_ids.error
    np.testing.assert_allclose(by_ids.outputs["embedding"], by_text.outputs["embedding"], atol=1e-6)


def test_a_text_longer_than_the_model_is_cut_to_its_length(
    embedder: Loaded,
) -> None:
    long = " ".join(["music"] * 200)
    (response,) = run(embedder, InferenceRequest(body=long.encode()))

    assert response.error is None, response.error
    assert response.outputs["tokens"].tolist() == [64]  # the exported --max-seq-len


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (InferenceRequest(body=b""), "the request has no text"),
        (InferenceRequest(body=b"[1, 2]", content_type="application/json"),
         "send a text, or a non-empty list of texts"),
        (InferenceRequest(body=b"\xff\xfe", content_type="text/plain"), "not valid UTF-8"),
        (InferenceRequest(body=b'{"prompt": "x"}'), "needs the text under one of"),
        (InferenceRequest(inputs={"a": np.array([b"x"], object), "b": np.array([b"y"], object)}),
         "one BYTES tensor"),
        (InferenceRequest(inputs={"input_ids": np.array([[1, 99999]])}), "token ids must be in"),
    ],
)  # fmt: skip
def test_bad_texts_fail_alone_with_400(
    classifier: Loaded, request_: InferenceRequest, message: str
) -> None:
    bad, good = run(classifier, request_, InferenceRequest(body=b"a dog"))

    assert bad.status == 400 and message in (bad.error or ""), bad.error
    assert good.error is None


def test_an_archive_without_its_tokenizer_is_refused_at_load(zoo: ZooStore, tmp_path: Path) -> None:
    with open_archive(zoo.archive("bert")) as reader:
        shutil.copytree(reader.root, tmp_path / "bert")
        manifest = reader.manifest
    (tmp_path / "bert" / "tokenizer.json").unlink()

    with pytest.raises(HandlerError) as info:
        load_handler(Context("bert", "1.0", tmp_path / "bert", manifest))
    assert "--extra-files tokenizer.json" in info.value.message


def test_the_backend_refuses_sequences_longer_than_exported_with_400(zoo: ZooStore) -> None:
    from scriptserve.handlers.backends import InputRejected, load_backend

    with open_archive(zoo.archive("bert")) as reader:
        manifest = reader.manifest
        backend = load_backend(
            reader.root / "bert.pt2", "pt2", manifest=manifest, options={}, workers=1
        )
        for length, fits in ((64, True), (65, False)):
            ids = np.ones((2, length), np.int64)
            inputs = {"input_ids": ids, "attention_mask": ids, "token_type_ids": 0 * ids}
            if fits:
                assert backend.run(inputs)["output0"].shape == (2, 3)
                continue
            with pytest.raises(InputRejected) as info:
                backend.run(inputs)
            assert info.value.status == 400
            assert "has 65 positions; the .pt2 model takes 1 to 64" in str(info.value)
