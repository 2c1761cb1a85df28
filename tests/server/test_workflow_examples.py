"""TorchServe's own workflow examples, unmodified: the specs and workflow handlers of
`examples/Workflows/dog_breed_classification` and `examples/Workflows/nmt_transformers_pipeline`
(copied as they are into `torchserve_workflows/`, with the dog-breed example's two model
handlers and its `index_to_name.json`), archived by torch-workflow-archiver over `.mar` files
made here, registered through `/workflows` and run by `/wfpredict` on a real server.

The examples' models are pretrained (a ResNet cat/dog classifier, a dog-breed classifier,
fairseq translators) and no model hub is reachable, so the archives carry small TorchScript
models with the same interfaces, made to answer predictably: the cat/dog model calls a red image
a dog and a blue one a cat, the breed model's top class follows the image's colour, and the
translators map words through a table (English, German, French)."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from serving import ServerProcess
from torch import nn
from torchserve.tsarchives import torch_model_archiver, write

# Slow: archives made by TorchServe's tools, and a server.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parent / "torchserve_workflows"
DOG_BREED = EXAMPLES / "dog_breed_classification"
NMT = EXAMPLES / "nmt_transformers_pipeline"
BREEDS: dict[str, str] = json.loads((DOG_BREED / "index_to_name.json").read_text())


class Colour(nn.Module):
    """An image model that looks only at the mean colour of what the handler normalized."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def rgb(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.std + self.mean).mean(dim=(2, 3))


class CatDog(Colour):
    """Two logits, cat then dog: more blue than red is a cat."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rgb = self.rgb(x)
        dog = rgb[:, 0] - rgb[:, 2]
        return torch.stack([-dog, dog], dim=1)


class Breed(Colour):
    """133 logits peaking at class `50 * red + 80 * green` (the image's mean colour in [0, 1])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rgb = self.rgb(x)
        peak = torch.round(50 * rgb[:, 0] + 80 * rgb[:, 1]).unsqueeze(1)
        classes = torch.arange(133, dtype=torch.float32).unsqueeze(0)
        return -((classes - peak) ** 2)


def breed_of(red: int, green: int) -> str:
    return BREEDS[str(round(50 * red / 255 + 80 * green / 255))]


# The translators: a table from source word ids to target word ids, the words in the archive.
WORDS = {
    "en": ["hello", "world", "my", "friend", "good", "morning"],
    "de": ["hallo", "welt", "mein", "freund", "guten", "morgen"],
    "fr": ["bonjour", "monde", "mon", "ami", "bon", "matin"],
}

TRANSLATOR = """
import json

import torch
from ts.torch_handler.base_handler import BaseHandler


class Translator(BaseHandler):
    # Text in; {"input": text, "<language>_output": translation} out, as the example's
    # fairseq handler answers. Words outside the vocabulary pass through as they are.

    def initialize(self, context):
        super().initialize(context)
        with open(f"{context.system_properties['model_dir']}/translation.json") as f:
            spec = json.load(f)
        self.source, self.target, self.key = spec["source"], spec["target"], spec["key"]

    def preprocess(self, data):
        self.texts = []
        for row in data:
            text = row.get("data") or row.get("body")
            self.texts.append(text.decode() if isinstance(text, (bytes, bytearray)) else text)
        words = [w for t in self.texts for w in t.lower().split()]
        ids = [self.source.index(w) if w in self.source else -1 for w in words]
        return torch.tensor(ids, dtype=torch.long)

    def inference(self, data, *args, **kwargs):
        return self.model(data.clamp(min=0)), data

    def postprocess(self, data):
        mapped, ids = data
        out, at = [], 0
        for text in self.texts:
            words = text.lower().split()
            translated = [
                self.target[mapped[at + i]] if ids[at + i] >= 0 else word
                for i, word in enumerate(words)
            ]
            at += len(words)
            out.append({"input": text, self.key: " ".join(translated)})
        return out
"""


class Lookup(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def translate(text: str, source: str, target: str) -> str:
    words = WORDS[source]
    return " ".join(
        WORDS[target][words.index(w)] if w in words else w for w in text.lower().split()
    )


def workflow_archiver(src: Path, out: Path, name: str, spec: Path, handler: Path) -> None:
    done = subprocess.run(
        [
            "torch-workflow-archiver",
            "--workflow-name",
            name,
            "--spec-file",
            str(spec),
            "--handler",
            str(handler),
            "--export-path",
            str(out),
            "-f",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=src,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workflow-examples")
    src, store = root / "src", root / "store"
    src.mkdir()
    store.mkdir()
    for name in (
        "cat_dog_classification_handler.py",
        "dog_breed_classification_handler.py",
        "index_to_name.json",
    ):
        shutil.copy(DOG_BREED / name, src / name)
    torch.jit.script(CatDog()).save(str(src / "cat_dog.pt"))
    torch.jit.script(Breed()).save(str(src / "breed.pt"))
    torch_model_archiver(
        src,
        store,
        "cat_dog_classification",
        "--serialized-file",
        "cat_dog.pt",
        "--handler",
        "cat_dog_classification_handler.py",
    )
    torch_model_archiver(
        src,
        store,
        "dog_breed_classification",
        "--serialized-file",
        "breed.pt",
        "--handler",
        "dog_breed_classification_handler.py",
        "--extra-files",
        "index_to_name.json",
    )
    workflow_archiver(
        src,
        store,
        "dog_breed_wf",
        DOG_BREED / "workflow_dog_breed_classification.yaml",
        DOG_BREED / "workflow_dog_breed_classification_handler.py",
    )

    write(src / "translator.py", TRANSLATOR)
    torch.jit.script(Lookup(len(WORDS["en"]))).save(str(src / "lookup.pt"))
    for archive, source, target, key in (
        ("TransformerEn2De", "en", "de", "german_output"),
        ("TransformerEn2Fr", "en", "fr", "french_output"),
        ("TransformerDe2En", "de", "en", "english_output"),
    ):
        table = {"source": WORDS[source], "target": WORDS[target], "key": key}
        (src / "translation.json").write_text(json.dumps(table))
        torch_model_archiver(
            src,
            store,
            archive,
            "--serialized-file",
            "lookup.pt",
            "--handler",
            "translator.py",
            "--extra-files",
            "translation.json",
        )
    workflow_archiver(
        src,
        store,
        "nmt_wf_dual",
        NMT / "nmt_workflow_dualtranslation.yaml",
        NMT / "nmt_workflow_handler_dualtranslation.py",
    )
    workflow_archiver(
        src,
        store,
        "nmt_wf_re",
        NMT / "nmt_workflow_retranslation.yaml",
        NMT / "nmt_workflow_handler_retranslation.py",
    )
    return store


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(store, "--enable-model-api", "--no-snapshot")
    proc.start()
    yield proc
    proc.stop()


def register(server: ServerProcess, name: str) -> None:
    with httpx.Client(timeout=120, headers=server.mgmt_headers) as client:
        registered = client.post(f"{server.mgmt}/workflows", params={"url": f"{name}.war"})
    assert registered.status_code == 200, registered.text
    assert registered.json() == {
        "status": f"Workflow {name} has been registered and scaled successfully."
    }


def unregister(server: ServerProcess, name: str) -> None:
    with httpx.Client(timeout=60, headers=server.mgmt_headers) as client:
        gone = client.delete(f"{server.mgmt}/workflows/{name}")
    assert gone.json() == {"status": f'Workflow "{name}" unregistered'}


def image(red: int, green: int, blue: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (red, green, blue)).save(out, format="JPEG", quality=95)
    return out.getvalue()


def test_dog_breed_example_answers_cats_and_breeds_as_its_readme_shows(
    server: ServerProcess,
) -> None:
    """`curl /wfpredict/dog_breed_wf -T Cat.jpg` answers "It's a cat!"; a dog, its five most
    likely breeds; three at once (the README's last call) each get their own answer."""
    register(server, "dog_breed_wf")
    url = f"{server.url}/wfpredict/dog_breed_wf"
    cat = httpx.post(url, content=image(0, 0, 255), timeout=60)
    assert cat.status_code == 200, cat.text
    assert cat.text == "It's a cat!"
    dog = httpx.post(url, content=image(255, 0, 0), timeout=60)
    assert dog.status_code == 200, dog.text
    breeds = dog.json()
    assert len(breeds) == 5
    assert max(breeds, key=breeds.get) == breed_of(255, 0)

    async def three_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            bodies = (image(255, 0, 0), image(0, 0, 255), image(255, 128, 0))
            return await asyncio.gather(*(client.post(url, content=b) for b in bodies))

    first, second, third = asyncio.run(three_at_once())
    assert max(first.json(), key=first.json().get) == breed_of(255, 0)
    assert second.text == "It's a cat!"
    assert max(third.json(), key=third.json().get) == breed_of(255, 128)
    assert breed_of(255, 0) != breed_of(255, 128)

    with httpx.Client(timeout=60, headers=server.mgmt_headers) as client:
        described = client.get(f"{server.mgmt}/workflows/dog_breed_wf").json()[0]
        assert described["batchSize"] == 4 and described["maxBatchDelay"] == 100
        node = described["nodes"]["dog_breed_classification"]
        assert node["retry-attempts"] == 5 and node["timeout-ms"] == 300000
        model = client.get(f"{server.mgmt}/models/dog_breed_wf__cat_dog_classification").json()
        assert model[0]["batchSize"] == 4 and model[0]["minWorkers"] == 1
    unregister(server, "dog_breed_wf")


def test_dual_translation_example_meets_in_its_aggregate_function(
    server: ServerProcess,
) -> None:
    """pre_processing -> (nmt_en_de, nmt_en_fr) -> aggregate_func, which reads each parent's
    answer by the parent's node name."""
    register(server, "nmt_wf_dual")
    for text in ("Hello World !!!", "good morning my friend"):
        answer = httpx.post(f"{server.url}/wfpredict/nmt_wf_dual", content=text, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "english_input": text,
            "german_translation": translate(text, "en", "de"),
            "french_translation": translate(text, "en", "fr"),
        }
    unregister(server, "nmt_wf_dual")


def test_retranslation_example_starts_at_a_model_and_chains_functions(
    server: ServerProcess,
) -> None:
    """nmt_en_de -> prep_intermediate_input -> nmt_de_en -> post_processing: the start node is a
    model, which gets the request's body."""
    register(server, "nmt_wf_re")
    text = "Hello my friend"
    answer = httpx.post(f"{server.url}/wfpredict/nmt_wf_re", content=text, timeout=60)
    assert answer.status_code == 200, answer.text
    german = translate(text, "en", "de")
    assert answer.json() == {
        "german_translation": german,
        "english_re_translation": translate(german, "de", "en"),
    }
    assert german == "hallo mein freund"
    unregister(server, "nmt_wf_re")
