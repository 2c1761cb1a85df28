"""TorchServe's image_classifier and text_classifier built-ins, from torch-model-archiver."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn
from torchserve.tsarchives import torch_model_archiver

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.base import Context, HandlerError, InferenceRequest
from scriptserve.handlers.loader import load_handler, read_model_config

LABELS = ["zero", "one", "two", "three", "four", "five"]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class PooledClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc = nn.Linear(3, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.bag = nn.EmbeddingBag(8, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, text: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(text, offsets))


def script(module: nn.Module, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(module.eval()).save(str(path))


def run(archive: Path, requests: list[InferenceRequest]) -> list[object]:
    with open_archive(archive) as reader:
        m = reader.manifest
        context = Context(
            m.model.model_name, "1.0", reader.root, m, read_model_config(reader.root, m)
        )
        handler = load_handler(context)
        return [r.body for r in handler.handle(requests, context)]


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_image_classifier_returns_the_top_five_labels(tmp_path: Path) -> None:
    script(PooledClassifier(), tmp_path / "img.pt")
    (tmp_path / "index_to_name.json").write_text(
        json.dumps({str(i): ["n0000", name] for i, name in enumerate(LABELS)})
    )
    archive = torch_model_archiver(
        tmp_path,
        tmp_path,
        "img",
        "--serialized-file",
        "img.pt",
        "--handler",
        "image_classifier",
        "--extra-files",
        "index_to_name.json",
    )
    colors = [(200, 30, 90), (10, 250, 120)]
    requests = [
        InferenceRequest(fields={"data": png(c, (320, 240))}, body=png(c, (320, 240)))
        for c in colors
    ]
    bodies = run(archive, requests)

    for color, body in zip(colors, bodies, strict=True):
        # A plain colour stays plain through resize and crop: the normalized pixel is known.
        pixel = torch.tensor([(c / 255 - m) / s for c, m, s in zip(color, MEAN, STD, strict=True)])
        with torch.inference_mode():
            probs = torch.softmax(PooledClassifier().fc(pixel[None]), dim=1)[0]
        top = torch.topk(probs, 5)
        want = {
            LABELS[i]: p for i, p in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        }
        assert isinstance(body, dict)
        assert list(body) == list(want)
        assert body == pytest.approx(want, abs=1e-4)


def test_image_classifier_rejects_bytes_that_are_no_image(tmp_path: Path) -> None:
    script(PooledClassifier(), tmp_path / "img.pt")
    archive = torch_model_archiver(
        tmp_path, tmp_path, "img2", "--serialized-file", "img.pt", "--handler", "image_classifier"
    )
    with pytest.raises(HandlerError) as info:
        run(archive, [InferenceRequest(body=b"not an image", content_type="image/jpeg")])
    assert info.value.status == 400
    assert "not an image" in info.value.message


def test_text_classifier_scores_every_class(tmp_path: Path) -> None:
    script(BagClassifier(), tmp_path / "text.pt")
    vocab = {"<unk>": 0, "it": 1, "is": 2, "not": 3, "good": 4, "it is": 5, "is not": 6}
    torch.save(vocab, tmp_path / "source_vocab.pt")
    (tmp_path / "index_to_name.json").write_text(json.dumps({"0": "neg", "1": "neu", "2": "pos"}))
    archive = torch_model_archiver(
        tmp_path,
        tmp_path,
        "text",
        "--serialized-file",
        "text.pt",
        "--handler",
        "text_classifier",
        "--extra-files",
        "source_vocab.pt,index_to_name.json",
    )
    (body,) = run(
        archive, [InferenceRequest(body=b"It isn't <b>good</b>!", content_type="text/plain")]
    )

    # "It isn't <b>good</b>!" -> "it is not good" -> unigrams + bigrams; "not good" is unknown.
    ids = [1, 2, 3, 4, 5, 6, 0]
    with torch.inference_mode():
        probs = torch.softmax(BagClassifier()(torch.tensor(ids), torch.tensor([0])), dim=1)[0]
    assert body == pytest.approx(dict(zip(["neg", "neu", "pos"], probs.tolist(), strict=True)))


def test_text_classifier_refuses_a_pickled_vocabulary(tmp_path: Path) -> None:
    script(BagClassifier(), tmp_path / "text.pt")
    torch.save({"stoi": Path("x")}, tmp_path / "source_vocab.pt")
    archive = torch_model_archiver(
        tmp_path,
        tmp_path,
        "text2",
        "--serialized-file",
        "text.pt",
        "--handler",
        "text_classifier",
        "--extra-files",
        "source_vocab.pt",
    )
    with open_archive(archive) as reader, pytest.raises(HandlerError) as info:
        load_handler(Context("text2", "1.0", reader.root, reader.manifest))
    assert "torch.save(dict(vocab.get_stoi()), 'source_vocab.pt')" in info.value.message
