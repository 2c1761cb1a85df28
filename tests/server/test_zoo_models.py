"""The zoo's models behind a real server: the BERT classifier over TorchServe's `/predictions`,
KServe v1, the Open Inference Protocol over REST and gRPC (Triton's clients, BYTES tensors);
ResNet-50 and ViT with JPEGs over REST and gRPC; the sentence embedder behind OpenAI's
`/v1/embeddings`, called by the `openai` client unchanged."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image
from serving import ServerProcess
from zoo_archives import ZooStore

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.base import Context, InferenceRequest, InferenceResponse, run_batch
from scriptserve.handlers.loader import load_handler, read_model_config

# Slow: the zoo's models, built and compiled for the session.
pytestmark = pytest.mark.slow

TEXTS = ["the quick brown fox", "a dog and a cat are happy", "music"]


@pytest.fixture(scope="module")
def server(zoo: ZooStore, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("text-models") / "store"
    store.mkdir()
    for name in ("bert", "embedder", "resnet50", "vit"):
        shutil.copy(zoo.archive(name), store)
    proc = ServerProcess(store, "--models", "all").start(timeout_s=180)
    try:
        yield proc
    finally:
        proc.stop()


def in_process(archive: Path, *bodies: str | bytes) -> list[object]:
    """What the archive's handler answers each body with, in this process."""
    return [r.body for r in handled(archive, *bodies)]


def handled(archive: Path, *bodies: str | bytes) -> list[InferenceResponse]:
    name = archive.stem
    with open_archive(archive) as reader:
        manifest = reader.manifest
        config = read_model_config(reader.root, manifest)
        context = Context(name, "1.0", reader.root, manifest, config)
        requests = [InferenceRequest(body=b.encode() if isinstance(b, str) else b) for b in bodies]
        return run_batch(load_handler(context), requests, context)


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (240, 320, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.parametrize("model", ["resnet50", "vit"])
def test_vision_models_answer_jpegs_over_rest_and_grpc(server: ServerProcess, model: str) -> None:
    images = [jpeg(0), jpeg(1)]
    expected = handled(server.store / f"{model}.mar", *images)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        rest = client.post(
            f"/predictions/{model}", content=images[0], headers={"Content-Type": "image/jpeg"}
        )
    grpc = triton_grpc.InferenceServerClient(server.grpc)
    tensor = triton_grpc.InferInput("pixel_values", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object))
    logits = grpc.infer(model, [tensor]).as_numpy("output0")

    assert rest.status_code == 200, rest.text
    assert rest.json() == pytest.approx(expected[0].body)
    want = np.concatenate([e.outputs["output0"] for e in expected])
    np.testing.assert_allclose(logits, want, atol=1e-4)


def test_predictions_and_kserve_v1_answer_labels(server: ServerProcess) -> None:
    expected = in_process(server.store / "bert.mar", *TEXTS)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        one = client.post(
            "/predictions/bert", content=TEXTS[0], headers={"Content-Type": "text/plain"}
        )
        v1 = client.post("/v1/models/bert:predict", json={"instances": TEXTS})

    assert one.status_code == 200, one.text
    assert one.json() == pytest.approx(expected[0])
    assert v1.status_code == 200, v1.text
    assert [p for p in v1.json()["predictions"]] == [pytest.approx(e) for e in expected]


def test_oip_over_rest_and_grpc_take_bytes_tensors(server: ServerProcess) -> None:
    texts = np.array([t.encode() for t in TEXTS], dtype=object)
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    tensor = triton_http.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(texts)
    over_rest = http.infer("bert", [tensor]).as_numpy("logits")

    grpc = triton_grpc.InferenceServerClient(server.grpc)
    tensor_g = triton_grpc.InferInput("text", [len(TEXTS)], "BYTES")
    tensor_g.set_data_from_numpy(texts)
    over_grpc = grpc.infer("bert", [tensor_g]).as_numpy("logits")

    assert over_rest.shape == (3, 3)
    np.testing.assert_allclose(over_grpc, over_rest, atol=1e-6)
    expected = in_process(server.store / "bert.mar", *TEXTS)
    for row, answer in zip(over_rest, expected, strict=True):
        assert isinstance(answer, dict)
        assert int(np.argmax(row)) == int(next(iter(answer)).removeprefix("LABEL_"))


def test_the_openai_client_gets_the_embedders_vectors(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    expected = np.array(in_process(server.store / "embedder.mar", *TEXTS), dtype=np.float32)

    # The client asks for base64 by default and decodes it; float is asked for explicitly.
    default = client.embeddings.create(model="embedder", input=TEXTS)
    as_floats = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    one = client.embeddings.create(model="embedder", input=TEXTS[1])

    for reply in (default, as_floats):
        assert [d.index for d in reply.data] == [0, 1, 2]
        np.testing.assert_allclose([d.embedding for d in reply.data], expected, atol=1e-6)
        assert reply.model == "embedder"
    np.testing.assert_allclose(one.data[0].embedding, expected[1], atol=1e-6)
    counted = default.usage.prompt_tokens
    assert counted == default.usage.total_tokens == sum(len(t.split()) + 2 for t in TEXTS)


def test_embeddings_of_token_ids_and_fewer_dimensions(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        text = client.post("/v1/embeddings", json={"model": "embedder", "input": "music"})
        ids = text.json()
        (vector,) = [d["embedding"] for d in ids["data"]]
        tokens = client.post("/v1/embeddings", json={"model": "embedder", "input": [2, 50, 3]})
        short = client.post(
            "/v1/embeddings", json={"model": "embedder", "input": "music", "dimensions": 8}
        )

    assert tokens.status_code == 200, tokens.text
    assert short.status_code == 200, short.text
    first = np.array(vector[:8])
    np.testing.assert_allclose(
        short.json()["data"][0]["embedding"], first / np.linalg.norm(first), atol=1e-6
    )
    assert tokens.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "embedder"}, 400, '"input" is missing'),
        ({"model": "embedder", "input": []}, 400, '"input" must be a non-empty string or list'),
        ({"model": "embedder", "input": "x", "encoding_format": "int8"}, 400,
         '"encoding_format" must be "float" or "base64"'),
        ({"model": "embedder", "input": "x", "dimensions": 4096}, 400,
         '"dimensions" 4096 is more than model'),
        ({"model": "bert", "input": "x"}, 400, "does not answer with embeddings"),
        ({"model": "nope", "input": "x"}, 404, "nope"),
        ({"model": "embedder", "input": [[1, 2], [3, -1]]}, 400, "input 1: token ids must be in"),
    ],
)  # fmt: skip
def test_embeddings_errors_say_what_to_fix(
    server: ServerProcess, body: dict[str, object], status: int, message: str
) -> None:
    reply = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)

    assert reply.status_code == status, reply.text
    error = reply.json()["error"]  # OpenAI's error object
    assert message in error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_the_openai_client_raises_the_servers_message(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="bert", input="x")

    assert info.value.status_code == 400
    assert "does not answer with embeddings" in info.value.message
