"""The zoo's models behind a real server: the BERT classifier over TorchServe's `/predictions`,
KServe v1, the Open Inference Protocol over REST and gRPC (Triton's clients, BYTES tensors);
ResNet-50 and ViT with JPEGs over REST and gRPC; the sentence embedder behind OpenAI's
`/v1/embeddings`, called by the `openai` client unchanged, and over gRPC; GPT-2 streaming its
greedy continuation over every streaming route of both transports. The int8 archives are
served beside the fp32 ones and answer as they do in process."""

from __future__ import annotations

import io
import json
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image
from serving import ServerProcess
from tsprotos import torchserve_stubs
from zoo_archives import ZooStore, archive_name, zoo_greedy

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.base import Context, InferenceRequest, InferenceResponse, run_batch
from scriptserve.handlers.loader import load_handler, read_model_config

# Slow: the zoo's models, built and compiled for the session.
pytestmark = pytest.mark.slow

TEXTS = ["the quick brown fox", "a dog and a cat are happy", "music"]
ARCHIVES = [
    ("bert", "none"),
    ("embedder", "none"),
    ("embedder", "dynamic-int8"),
    ("gpt2", "none"),
    ("gpt2", "dynamic-int8"),
    ("resnet50", "none"),
    ("resnet50", "static-int8"),
    ("vit", "none"),
    ("vit", "dynamic-int8"),
]
"""What the server serves: (model, quantization), as tests/zoo_archives.py made them."""


@pytest.fixture(scope="module")
def server(zoo: ZooStore, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("text-models") / "store"
    store.mkdir()
    for name, quantize in ARCHIVES:
        shutil.copy(zoo.archive(name, quantize), store)
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


@pytest.mark.parametrize("model", ["resnet50", "resnet50_static_int8", "vit", "vit_dynamic_int8"])
def test_vision_models_answer_jpegs_over_rest_and_grpc(server: ServerProcess, model: str) -> None:
    images = [jpeg(0), jpeg(1)]
    # Each answer against the same batch in process: dynamic int8 scales a batch's activations
    # together, so a row's answer moves slightly with its neighbours (the guard bounds how far).
    archive = server.store / f"{model}.mar"
    (alone,) = handled(archive, images[0])
    expected = handled(archive, *images)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        rest = client.post(
            f"/predictions/{model}", content=images[0], headers={"Content-Type": "image/jpeg"}
        )
    rpc = triton_grpc.InferenceServerClient(server.grpc)
    tensor = triton_grpc.InferInput("pixel_values", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object))
    logits = rpc.infer(model, [tensor]).as_numpy("output0")

    assert rest.status_code == 200, rest.text
    assert rest.json() == pytest.approx(alone.body)
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

    rpc = triton_grpc.InferenceServerClient(server.grpc)
    tensor_g = triton_grpc.InferInput("text", [len(TEXTS)], "BYTES")
    tensor_g.set_data_from_numpy(texts)
    over_grpc = rpc.infer("bert", [tensor_g]).as_numpy("logits")

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


@pytest.mark.parametrize("model", ["embedder", "embedder_dynamic_int8"])
def test_the_embedder_answers_alike_over_rest_and_grpc(server: ServerProcess, model: str) -> None:
    expected = np.array(in_process(server.store / f"{model}.mar", *TEXTS), dtype=np.float32)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    over_rest = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")

    rpc = triton_grpc.InferenceServerClient(server.grpc)
    tensor = triton_grpc.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    over_grpc = rpc.infer(model, [tensor]).as_numpy("embedding")

    np.testing.assert_allclose([d.embedding for d in over_rest.data], expected, atol=1e-5)
    np.testing.assert_allclose(over_grpc, expected, atol=1e-5)


# -- GPT-2: a generator streams over each transport ---------------------------------------------
PROMPT = "a dog and a cat are happy and the music is good"
TOKENS = 8


def sse_parts(body: str) -> list[str]:
    """The `text_output` of each Server-Sent Event."""
    chunks = [c.removeprefix("data: ") for c in body.split("\n\n") if c]
    return [json.loads(c)["text_output"] for c in chunks]


def stream_infer_text(server: ServerProcess, model: str) -> tuple[str, int]:
    """Triton's ModelStreamInfer (tritonclient's streaming API): the replies' text, joined, up
    to the one marked final, and how many replies came."""
    replies: queue.Queue[tuple[object, object]] = queue.Queue()
    parts: list[str] = []
    with triton_grpc.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        prompt = triton_grpc.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
        client.async_stream_infer(model, [prompt], parameters={"max_tokens": TOKENS})
        while True:
            result, error = replies.get(timeout=60)
            assert error is None, error
            assert isinstance(result, triton_grpc.InferResult)
            parts.append(b"".join(result.as_numpy("text_output").ravel()).decode())
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return "".join(parts), len(parts)


@pytest.mark.parametrize("quantize", ["none", "dynamic-int8"])
def test_gpt2_streams_its_greedy_continuation_over_rest_and_grpc(
    server: ServerProcess, zoo: ZooStore, quantize: str
) -> None:
    """fp32 and dynamic int8 alike: the eager fp32 model's greedy continuation, a token per
    part, over TorchServe's `/predictions` (chunked, or in one piece when the whole answer is
    made before the first part is written) and `StreamPredictions`, Triton's `/generate_stream`
    (Server-Sent Events) and `ModelStreamInfer`."""
    model = archive_name("gpt2", quantize)
    want = zoo_greedy(zoo.model("gpt2"), PROMPT, TOKENS)
    body = {"text_input": PROMPT, "max_tokens": TOKENS}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", f"/predictions/{model}", json=body) as r:
            assert r.status_code == 200, r.read()
            chunked = b"".join(r.iter_bytes()).decode()
        sse = client.post(
            f"/v2/models/{model}/generate_stream",
            json={"text_input": PROMPT, "parameters": {"max_tokens": TOKENS}},
        )
    assert sse.status_code == 200, sse.text

    ts = torchserve_stubs()
    with grpc.insecure_channel(server.grpc) as channel:
        stub = ts.ts_grpc.InferenceAPIsServiceStub(channel)
        request = ts.ts.PredictionsRequest(
            model_name=model, input={"data": json.dumps(body).encode()}
        )
        messages = [r.prediction for r in stub.StreamPredictions(request, timeout=60)]
    streamed, replies = stream_infer_text(server, model)

    assert want and chunked == want
    events = sse_parts(sse.text)
    assert "".join(events) == want
    assert b"".join(messages).decode() == want
    assert streamed == want
    # A part per token (this continuation has no character split across tokens).
    assert len(events) == len(messages) == replies == TOKENS
