"""Triton's bidirectional `ModelStreamInfer` with tritonclient's streaming API: every request of
a stream is answered with its own output and `id`, a bad request fails alone while the stream
goes on, requests of one stream batch together, and a cancelled stream leaves nothing queued."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as triton
from serving import ServerProcess
from testmodels import reference_output
from tritonclient.grpc import InferResult
from tritonclient.utils import InferenceServerException

from .conftest import metric, pending_requests

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

Answer = tuple[InferResult | None, InferenceServerException | None]


def row_input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def collect(answers: queue.Queue[Answer], count: int, timeout_s: float = 60.0) -> list[Answer]:
    deadline = time.monotonic() + timeout_s
    got = []
    while len(got) < count:
        got.append(answers.get(timeout=max(0.01, deadline - time.monotonic())))
    return got


def test_each_request_gets_its_own_answer_and_id(server: ServerProcess) -> None:
    answers: queue.Queue[Answer] = queue.Queue()
    inputs = {f"req-{i}": np.full((1 + i % 3, 8), i / 10 - 1, np.float32) for i in range(24)}
    with triton.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for request_id, x in inputs.items():
            client.async_stream_infer("tiny", [row_input(x)], request_id=request_id)
        got = collect(answers, len(inputs))
        client.stop_stream()
    seen = set()
    for result, error in got:
        assert error is None, error
        assert result is not None
        request_id = result.get_response().id
        expected = reference_output(inputs[request_id])
        np.testing.assert_allclose(result.as_numpy("output0"), expected, rtol=1e-5, atol=1e-6)
        seen.add(request_id)
    assert seen == set(inputs)


def test_a_bad_request_fails_alone_and_the_stream_goes_on(server: ServerProcess) -> None:
    answers: queue.Queue[Answer] = queue.Queue()
    good = np.ones((1, 8), np.float32)
    with triton.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("tiny", [row_input(good)], request_id="before")
        bad = row_input(np.ones((1, 5), np.float32))
        client.async_stream_infer("tiny", [bad], request_id="bad")
        client.async_stream_infer("nope", [row_input(good)], request_id="unknown")
        first = collect(answers, 3)
        client.async_stream_infer("tiny", [row_input(good)], request_id="after")
        second = collect(answers, 1)
        client.stop_stream()
    results = {r.get_response().id for r, e in first + second if e is None and r is not None}
    errors = [str(e.message()) for _, e in first + second if e is not None]
    assert results == {"before", "after"}
    assert len(errors) == 2
    assert any("'nope'" in e and "not registered" in e for e in errors), errors
    assert any("'x'" in e and "[-1, 8]" in e for e in errors), errors


def test_requests_of_one_stream_batch_together(slow_server: ServerProcess) -> None:
    count = 12
    before = (
        metric(slow_server, "scriptserve_batch_size_sum", model="slow"),
        metric(slow_server, "scriptserve_batch_size_count", model="slow"),
    )
    answers: queue.Queue[Answer] = queue.Queue()
    with triton.InferenceServerClient(slow_server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i in range(count):
            x = np.full((1, 8), i, np.float32)
            client.async_stream_infer("slow", [row_input(x)], request_id=str(i))
        got = collect(answers, count)
        client.stop_stream()
    assert all(error is None for _, error in got)
    rows = metric(slow_server, "scriptserve_batch_size_sum", model="slow") - before[0]
    batches = metric(slow_server, "scriptserve_batch_size_count", model="slow") - before[1]
    assert rows == count
    # One worker that holds each batch 0.3 s: the first request runs alone, the rest queue behind
    # it and run together, so far fewer batches than requests.
    assert batches <= count / 2


def test_a_cancelled_stream_leaves_nothing_queued(slow_server: ServerProcess) -> None:
    answers: queue.Queue[Answer] = queue.Queue()
    client = triton.InferenceServerClient(slow_server.grpc)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i in range(200):
            x = row_input(np.ones((1, 8), np.float32))
            client.async_stream_infer("slow", [x], request_id=str(i))
        deadline = time.monotonic() + 30
        while pending_requests(slow_server, "slow") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pending_requests(slow_server, "slow") > 0
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while pending_requests(slow_server, "slow") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pending_requests(slow_server, "slow") == 0
    # The model still serves after the cancelled stream.
    with triton.InferenceServerClient(slow_server.grpc) as client:
        result = client.infer("slow", [row_input(np.ones((1, 8), np.float32))])
    np.testing.assert_allclose(
        result.as_numpy("output0"), reference_output(np.ones((1, 8), np.float32)), rtol=1e-5
    )
