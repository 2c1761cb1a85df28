"""Streamed answers over REST against a real server: TorchServe's chunked `/predictions`, Triton's
`/generate_stream` (Server-Sent Events), batching of streams, a TorchServe streaming handler
packed by torch-model-archiver, and what a client that leaves, reads slowly or runs out of time
does to the server (nothing lasting)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from serving import ServerProcess
from streamstore import MAX_UNREAD, SEND_TIMEOUT_S
from testmodels import TinyLM, greedy_text

# Slow: two small language models trained for its server, and clients that wait out its timeouts.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(streaming_server: ServerProcess) -> ServerProcess:
    return streaming_server


def events(body: str) -> list[dict[str, Any]]:
    """The JSON of each Server-Sent Event's data."""
    chunks = [c for c in body.split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks), body
    return [json.loads(c.removeprefix("data: ")) for c in chunks]


def first_part_after(client: httpx.Client, url: str, model: str, prompt: str) -> float:
    """Seconds until the first event of a one-token stream (the worker's queue included)."""
    started = time.perf_counter()
    body = {"text_input": prompt, "parameters": {"max_tokens": 1}}
    with client.stream("POST", f"{url}/v2/models/{model}/generate_stream", json=body) as r:
        assert r.status_code == 200, r.read()
        next(r.iter_raw())
        return time.perf_counter() - started


def test_predictions_streams_tokens_as_http_chunks(server: ServerProcess, lm: TinyLM) -> None:
    body = {"text_input": "the quick", "max_tokens": 24}
    arrivals = []
    url = f"{server.url}/predictions/slowlm"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["content-type"].startswith("text/plain")
        text = ""
        for chunk in r.iter_bytes():
            arrivals.append(time.perf_counter())
            text += chunk.decode()
    assert text == greedy_text(lm, "the quick", 24)
    # Tokens arrive as they are made, not all at the end: ~30 ms apart.
    assert len(arrivals) >= 12, arrivals
    assert arrivals[-1] - arrivals[0] > 0.2


def test_generate_stream_sends_one_event_per_token(server: ServerProcess, lm: TinyLM) -> None:
    body = {"text_input": "the lazy", "parameters": {"max_tokens": 10}}
    r = httpx.post(f"{server.url}/v2/models/tinylm/generate_stream", json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    parts = events(r.text)
    assert len(parts) == 10
    assert {(p["model_name"], p["model_version"]) for p in parts} == {("tinylm", "1.0")}
    assert "".join(p["text_output"] for p in parts) == greedy_text(lm, "the lazy", 10)


def test_streams_of_one_batch_each_get_their_own_parts(server: ServerProcess, lm: TinyLM) -> None:
    prompts = [("the quick", 12), ("lazy", 5), ("fox ", 20), ("dog. ", 1), ("jumps", 9)] * 2
    stats_url = f"{server.url}/v2/models/tinylm/stats"
    before = httpx.get(stats_url).json()["model_stats"][0]

    def generate(prompt: str, n: int) -> str:
        body = {"text_input": prompt, "parameters": {"max_tokens": n}}
        r = httpx.post(f"{server.url}/v2/models/tinylm/generate_stream", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert all("text_output" in p for p in events(r.text)), r.text
        return "".join(p["text_output"] for p in events(r.text))

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda pn: generate(*pn), prompts))
    assert answers == [greedy_text(lm, p, n) for p, n in prompts]
    after = httpx.get(stats_url).json()["model_stats"][0]
    requests = after["inference_count"] - before["inference_count"]
    batches = after["execution_count"] - before["execution_count"]
    assert requests == len(prompts)
    assert batches < requests  # one worker: streams generated together


def test_one_bad_request_fails_alone_in_its_batch(server: ServerProcess, lm: TinyLM) -> None:
    bodies = [{"text_input": "the", "parameters": {"max_tokens": 4}}] * 3
    bodies.insert(1, {"text_input": "the", "parameters": {"max_tokens": 0}})
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda b: httpx.post(
                    f"{server.url}/v2/models/tinylm/generate_stream", json=b, timeout=30
                ),
                bodies,
            )
        )
    assert answers[1].status_code == 400
    assert answers[1].json() == {"error": "max_tokens must be a positive integer"}
    for r in (answers[0], answers[2], answers[3]):
        assert "".join(p["text_output"] for p in events(r.text)) == greedy_text(lm, "the", 4)


def test_one_piece_endpoints_point_to_the_streaming_ones(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v2/models/tinylm/generate", json={"text_input": "the"})
    assert r.status_code == 400
    assert "generate_stream" in r.json()["error"]
    infer = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}
    r = httpx.post(f"{server.url}/v2/models/tinylm/infer", json=infer)
    assert r.status_code == 400
    assert "ModelStreamInfer" in r.json()["error"]
    # Triton's word for a model that answers in parts: its clients then use the stream APIs.
    config = httpx.get(f"{server.url}/v2/models/tinylm/config").json()
    assert config["model_transaction_policy"] == {"decoupled": True}


def test_bad_generate_requests_say_what_to_send(server: ServerProcess) -> None:
    url = f"{server.url}/v2/models/tinylm/generate_stream"
    for body, message in (
        (b"[1, 2]", 'the request must be a JSON object, e.g. {"text_input": "..."}'),
        (b"{}", 'the request names no input; send e.g. {"text_input": "..."}'),
        (b'{"text_input": {"a": 1}}', "input 'text_input' must be a string, a number"),
        (b'{"text_input": "a", "parameters": 3}', "'parameters' must be an object"),
    ):
        r = httpx.post(url, content=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"].startswith(message)
    r = httpx.post(f"{server.url}/v2/models/nosuch/generate_stream", json={"text_input": "a"})
    assert r.status_code == 404


def test_torchserve_streaming_handler_runs_unmodified(server: ServerProcess) -> None:
    url = f"{server.url}/predictions/ts_stream"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, content=b"x") as r:
        assert r.status_code == 200
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.read() == b"part 0;part 1;part 2;done"


def test_a_client_that_leaves_frees_the_worker_at_once(server: ServerProcess) -> None:
    # 60 tokens take ~2 s on slowlm's only worker; the client leaves after two.
    body = {"text_input": "the quick", "parameters": {"max_tokens": 60}}
    with httpx.Client(timeout=30) as client:
        started = time.perf_counter()
        with client.stream(
            "POST", f"{server.url}/v2/models/slowlm/generate_stream", json=body
        ) as r:
            parts = r.iter_raw()
            next(parts)
            next(parts)
        left = time.perf_counter()
        token_s = (left - started) / 2
        waited = first_part_after(client, server.url, "slowlm", "lazy")
    # The worker noticed within a step or two, not after the 58 tokens left (~1.7 s).
    assert waited < 8 * token_s + 0.3, (waited, token_s)
    assert waited < 0.8


def test_the_deadline_covers_the_whole_stream(server: ServerProcess, lm: TinyLM) -> None:
    body = {"text_input": "the quick", "parameters": {"max_tokens": 60}}
    started = time.perf_counter()
    r = httpx.post(
        f"{server.url}/v2/models/slowlm/generate_stream",
        json=body,
        headers={"X-Request-Timeout": "0.5"},
        timeout=30,
    )
    elapsed = time.perf_counter() - started
    assert r.status_code == 200
    parts = events(r.text)
    assert parts[-1] == {"error": "no answer within the request's deadline of 0.5 s"}
    text = "".join(p["text_output"] for p in parts[:-1])
    assert 0 < len(text) < 60
    assert text == greedy_text(lm, "the quick", len(text))
    assert elapsed < 1.5
    with httpx.Client(timeout=30) as client:
        assert first_part_after(client, server.url, "slowlm", "dog") < 0.8


def test_a_slow_reader_cannot_make_the_server_buffer(server: ServerProcess) -> None:
    # 400 parts of 64 KiB (26 MB) to a client that reads nothing for a while: the server keeps
    # at most MAX_UNREAD parts (and the sockets' buffers), then ends the stream with a 429 part.
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{server.url}/predictions/bigparts", content=b"x") as r:
            assert r.status_code == 200
            time.sleep(2.0)
            body = r.read()
        error = json.loads(body[body.rindex(b"{") :])
        assert error["code"] == 429
        assert error["type"] == "StreamOverrun"
        assert f"{MAX_UNREAD} parts waited unread" in error["message"]
        received = body.rindex(b"{") // 65536
        assert MAX_UNREAD <= received < 400
        # The worker stopped producing: the next stream on the only worker starts at once.
        assert first_part_after(client, server.url, "tinylm", "the") < 0.8


def test_a_client_that_stops_reading_is_disconnected(server: ServerProcess) -> None:
    # nginx's send_timeout: nothing of the answer drained for SEND_TIMEOUT_S, and the server
    # closes the connection instead of holding it (and its stream) for ever.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /predictions/bigparts HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx"
        )
        time.sleep(SEND_TIMEOUT_S + 2.0)
        sock.settimeout(10)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                received += chunk
    # Without the timeout the server would still hold the connection, and this read would get
    # the rest of the answer: the parts buffered, the 429 part and the last chunk.
    assert not received.endswith(b"0\r\n\r\n")
    assert b"StreamOverrun" not in received


def test_process_workers_stream_too(server: ServerProcess, lm: TinyLM) -> None:
    params = {
        "url": "tinylm.mar", "model_name": "tinylm_process", "worker_mode": "process",
        "initial_workers": 1,
    }  # fmt: skip
    r = httpx.post(f"{server.mgmt}/models", params=params, headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    body = {"text_input": "the quick", "parameters": {"max_tokens": 16}}
    r = httpx.post(f"{server.url}/v2/models/tinylm_process/generate_stream", json=body, timeout=30)
    parts = events(r.text)
    assert len(parts) == 16
    assert "".join(p["text_output"] for p in parts) == greedy_text(lm, "the quick", 16)


def test_streams_are_counted_like_every_request(server: ServerProcess) -> None:
    # After the tests above: slowlm streams that ended normally, by the client, by the deadline.
    text = httpx.get(f"{server.metrics_url}/metrics").text
    lines = [
        line for line in text.splitlines()
        if line.startswith("scriptserve_requests_total") and 'model="slowlm"' in line
    ]  # fmt: skip
    assert any('status="499"' in line for line in lines), lines
    assert any('status="504"' in line for line in lines), lines
    assert any('status="200"' in line for line in lines), lines
