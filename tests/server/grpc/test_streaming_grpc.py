"""Streamed answers over gRPC against a real server: Triton's `ModelStreamInfer` with several
replies per request (tritonclient's streaming API, `triton_final_response`, the opt-in empty
final reply), TorchServe's `StreamPredictions` one message per part, the unary calls that refuse
a model answering in parts, and what a client that cancels or stops reading leaves behind
(nothing: the worker is free)."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from serving import ServerProcess
from streamstore import MAX_UNREAD
from testmodels import TinyLM, greedy_text
from tritonclient.grpc import InferResult
from tritonclient.utils import InferenceServerException

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

Answer = tuple[InferResult | None, InferenceServerException | None]


@pytest.fixture(scope="module")
def server(streaming_server: ServerProcess) -> ServerProcess:
    return streaming_server


@pytest.fixture(scope="module")
def inference(server: ServerProcess, torchserve_stubs: SimpleNamespace) -> Iterator[Any]:
    with grpc.insecure_channel(server.grpc) as channel:
        yield torchserve_stubs.ts_grpc.InferenceAPIsServiceStub(channel)


def prompt_input(text: str) -> triton.InferInput:
    tensor = triton.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return tensor


def final(result: InferResult) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def token(result: InferResult) -> str:
    return "".join(t.decode() for t in result.as_numpy("text_output").ravel())


def stream_until_final(
    server: ServerProcess, requests: dict[str, tuple[str, str, dict[str, Any]]], **options: Any
) -> dict[str, list[Answer]]:
    """Send each request (id -> model, prompt, parameters) on one stream; collect every reply
    by request id until each has had its final one (or an error)."""
    answers: queue.Queue[Answer] = queue.Queue()
    got: dict[str, list[Answer]] = {request_id: [] for request_id in requests}
    open_ids = set(requests)
    with triton.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for request_id, (model, text, parameters) in requests.items():
            client.async_stream_infer(
                model,
                [prompt_input(text)],
                request_id=request_id,
                parameters=parameters,
                **options,
            )
        while open_ids:
            result, error = answers.get(timeout=30)
            if error is not None:
                pytest.fail(f"the stream failed: {error}")
            assert result is not None
            request_id = result.get_response().id
            got[request_id].append((result, None))
            if final(result):
                open_ids.discard(request_id)
        client.stop_stream()
    return got


# -- Triton's ModelStreamInfer ------------------------------------------------------------------
def test_model_stream_infer_replies_once_per_token(server: ServerProcess, lm: TinyLM) -> None:
    got = stream_until_final(server, {"a": ("tinylm", "the quick", {"max_tokens": 8})})
    replies = [result for result, _ in got["a"] if result is not None]
    assert len(replies) == 8
    assert "".join(token(r) for r in replies) == greedy_text(lm, "the quick", 8)
    assert [final(r) for r in replies] == [False] * 7 + [True]
    response = replies[0].get_response()
    assert (response.model_name, response.model_version, response.id) == ("tinylm", "1.0", "a")


def test_requests_of_one_stream_generate_together(server: ServerProcess, lm: TinyLM) -> None:
    prompts = {
        f"r{i}": ("tinylm", text, {"max_tokens": 6 + i})
        for i, text in enumerate(["the quick", "a lazy", "brown fox", "over the"])
    }
    got = stream_until_final(server, prompts)
    for request_id, (_, text, parameters) in prompts.items():
        replies = [result for result, _ in got[request_id] if result is not None]
        assert "".join(token(r) for r in replies) == greedy_text(lm, text, parameters["max_tokens"])
        assert final(replies[-1]) and not any(final(r) for r in replies[:-1])


def test_an_empty_end_is_a_final_reply_only_when_asked_for(server: ServerProcess) -> None:
    answers: queue.Queue[Answer] = queue.Queue()
    with triton.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(
            "counter",
            [prompt_input("x")],
            request_id="asked",
            parameters={"count": 3},
            enable_empty_final_response=True,
        )
        asked = [answers.get(timeout=30) for _ in range(4)]
        client.async_stream_infer(
            "counter", [prompt_input("x")], request_id="silent", parameters={"count": 2}
        )
        silent = [answers.get(timeout=30) for _ in range(2)]
        with pytest.raises(queue.Empty):  # the empty end sends nothing
            answers.get(timeout=1.0)
        client.stop_stream()
    results = [r for r, e in asked + silent if e is None and r is not None]
    assert len(results) == 6
    assert [int(r.as_numpy("n")[0]) for r in results[:3]] == [0, 1, 2]
    assert [final(r) for r in results[:4]] == [False, False, False, True]
    empty = results[3].get_response()
    assert (empty.id, empty.model_name, empty.model_version) == ("asked", "counter", "1.0")
    assert not empty.outputs
    assert [final(r) for r in results[4:]] == [False, False]


def test_a_bad_request_fails_alone_and_the_stream_goes_on(server: ServerProcess) -> None:
    answers: queue.Queue[Answer] = queue.Queue()
    with triton.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(
            "tinylm", [prompt_input("the")], request_id="bad", parameters={"max_tokens": 10_000}
        )
        client.async_stream_infer(
            "tinylm", [prompt_input("the")], request_id="good", parameters={"max_tokens": 2}
        )
        got = [answers.get(timeout=30) for _ in range(3)]
        client.stop_stream()
    errors = [str(e) for _, e in got if e is not None]
    assert len(errors) == 1 and "max_tokens 10000 is more than this model generates" in errors[0]
    good = [r for r, e in got if r is not None]
    assert [final(r) for r in good] == [False, True]


def test_unary_model_infer_points_to_the_stream(server: ServerProcess) -> None:
    with (
        triton.InferenceServerClient(server.grpc) as client,
        pytest.raises(InferenceServerException) as exc,
    ):
        client.infer("tinylm", [prompt_input("the")])
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "answers in parts" in exc.value.message() and "ModelStreamInfer" in exc.value.message()


def first_token_after(server: ServerProcess) -> float:
    """Seconds until slowlm's first part over a fresh ModelStreamInfer (its queue included)."""
    answers: queue.Queue[Answer] = queue.Queue()
    with triton.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        started = time.perf_counter()
        client.async_stream_infer("slowlm", [prompt_input("lazy")], parameters={"max_tokens": 1})
        _, error = answers.get(timeout=30)
        waited = time.perf_counter() - started
        client.stop_stream()
    assert error is None, error
    return waited


def test_cancelling_the_stream_frees_the_worker(server: ServerProcess) -> None:
    # 60 tokens take ~2 s on slowlm's only worker; the client cancels after two.
    answers: queue.Queue[Answer] = queue.Queue()
    with triton.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        started = time.perf_counter()
        client.async_stream_infer(
            "slowlm", [prompt_input("the quick")], parameters={"max_tokens": 60}
        )
        for _ in range(2):
            assert answers.get(timeout=30)[1] is None
        token_s = (time.perf_counter() - started) / 2
        client.stop_stream(cancel_requests=True)
    waited = first_token_after(server)
    # The worker noticed within a step or two, not after the 58 tokens left (~1.7 s).
    assert waited < 8 * token_s + 0.3, (waited, token_s)
    assert waited < 0.8


# -- TorchServe's StreamPredictions -------------------------------------------------------------
def ts_request(ts: SimpleNamespace, model: str, body: dict[str, Any]) -> Any:
    return ts.ts.PredictionsRequest(model_name=model, input={"data": json.dumps(body).encode()})


def test_stream_predictions_sends_one_message_per_token(
    inference: Any, torchserve_stubs: SimpleNamespace, lm: TinyLM
) -> None:
    body = {"text_input": "the quick", "max_tokens": 12}
    replies = list(inference.StreamPredictions(ts_request(torchserve_stubs, "tinylm", body)))
    assert len(replies) == 12
    assert b"".join(r.prediction for r in replies).decode() == greedy_text(lm, "the quick", 12)


def test_stream_predictions_runs_torchserve_streaming_handlers(
    inference: Any, torchserve_stubs: SimpleNamespace
) -> None:
    request = ts_request(torchserve_stubs, "ts_stream", {"x": 1})
    replies = [r.prediction for r in inference.StreamPredictions(request, timeout=30)]
    assert replies == [b"part 0;", b"part 1;", b"part 2;", b"done"]


def test_stream_predictions_errors_end_the_call_with_their_status(
    inference: Any, torchserve_stubs: SimpleNamespace
) -> None:
    cases = [
        ("tinylm", {"text_input": "x", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT),
        ("nope", {"text_input": "x"}, grpc.StatusCode.NOT_FOUND),
    ]
    for model, body, code in cases:
        with pytest.raises(grpc.RpcError) as exc:
            list(inference.StreamPredictions(ts_request(torchserve_stubs, model, body), timeout=30))
        assert exc.value.code() == code, exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        inference.Predictions(ts_request(torchserve_stubs, "tinylm", {"text_input": "x"}))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "StreamPredictions" in exc.value.details()


def test_stream_predictions_cancelled_frees_the_worker(
    server: ServerProcess, inference: Any, torchserve_stubs: SimpleNamespace
) -> None:
    body = {"text_input": "the quick", "max_tokens": 60}
    call = inference.StreamPredictions(ts_request(torchserve_stubs, "slowlm", body), timeout=30)
    started = time.perf_counter()
    next(call), next(call)
    token_s = (time.perf_counter() - started) / 2
    call.cancel()
    waited = first_token_after(server)
    assert waited < 8 * token_s + 0.3, (waited, token_s)
    assert waited < 0.8


def test_a_reader_that_falls_behind_is_ended_not_buffered(
    inference: Any, torchserve_stubs: SimpleNamespace
) -> None:
    # bigparts makes 400 parts of 64 KiB as fast as it can; the client reads one, then waits.
    # HTTP/2 flow control stops the server's writes, at most MAX_UNREAD parts wait in its
    # stream, and the call ends with RESOURCE_EXHAUSTED instead of the server buffering 25 MiB.
    call = inference.StreamPredictions(ts_request(torchserve_stubs, "bigparts", {}), timeout=60)
    next(call)
    time.sleep(3.0)
    received = 1
    with pytest.raises(grpc.RpcError) as exc:
        for _ in call:
            received += 1
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{MAX_UNREAD} parts waited unread" in exc.value.details()
    assert MAX_UNREAD <= received < 400


def test_intermediate_responses_of_a_model_that_answers_once_are_replies_too(
    server: ServerProcess,
) -> None:
    # `intermediate` does not declare that it streams; the parts its handler sends (as a
    # TorchServe handler's send_intermediate_predict_response does) still reach ModelStreamInfer,
    # each as a reply, before the answer the handler returns.
    got = stream_until_final(server, {"i": ("intermediate", "x", {})})
    replies = [result for result, _ in got["i"] if result is not None]
    assert [int(r.as_numpy("n")[0]) for r in replies] == [0, 1, 2]
    assert [final(r) for r in replies] == [False, False, True]
