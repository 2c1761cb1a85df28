"""Clients that hang up mid-body: each is a debug line naming the route and a count in
`scriptserve_client_disconnects_total`, never a traceback; the server keeps answering, and its
memory and open files stay bounded however many do it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

ROUNDS = 20
SOAK_ROUNDS = 200
RSS_GROWTH_BOUND = 30 * 2**20
"""What 200 abandoned requests may add to the server's memory (each leaves nothing behind; the
bound is allocator noise and caches warming up)."""
FD_SLACK = 8


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(store, "--workers", "1", "--log-level", "debug").start()
    yield proc
    proc.stop()


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def hang_up_mid_body(server: ServerProcess, path: str, chunked: bool = False) -> None:
    """Send the headers of a 100000-byte body and 10 bytes of it, then close the connection."""
    framing = "Transfer-Encoding: chunked" if chunked else "Content-Length: 100000"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{framing}\r\n\r\n"
    ).encode()
    part = b"186a0\r\n" + b'{"inputs":' if chunked else b'{"inputs":'
    with socket.create_connection(host_port(server.url), timeout=10) as sock:
        sock.sendall(head + part)


def disconnects(server: ServerProcess) -> float:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "scriptserve_client_disconnects_total" and sample.labels == {
                "api": "inference"
            }:
                return float(sample.value)
    return 0.0


def wait_until(check: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def serves(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/tiny", json=[0.5] * 8, timeout=30)
    assert r.status_code == 200, r.text
    body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
    r = httpx.post(f"{server.url}/v2/models/tiny/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text


def hang_up_rounds(server: ServerProcess, rounds: int) -> None:
    """`rounds` hang-ups across both APIs' routes and both framings."""
    paths = ["/v2/models/tiny/infer", "/predictions/tiny", "/v2/models/tiny/versions/1.0/infer"]
    for i in range(rounds):
        hang_up_mid_body(server, paths[i % len(paths)], chunked=i % 4 == 3)


def test_a_client_gone_mid_body_is_counted_and_logs_no_traceback(server: ServerProcess) -> None:
    before = disconnects(server)
    hang_up_rounds(server, ROUNDS)
    wait_until(lambda: disconnects(server) - before == ROUNDS, f"{ROUNDS} disconnects counted")
    serves(server)
    log = server.output()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "client went away" in line]
    assert len(lines) == ROUNDS, lines
    assert all(" DEBUG scriptserve.rest: " in line for line in lines)
    assert any(line.endswith("POST /v2/models/{model_name}/infer") for line in lines)
    assert any(line.endswith("POST /predictions/{model_name}") for line in lines)


def test_many_clients_gone_mid_body_leave_memory_and_files_bounded(server: ServerProcess) -> None:
    assert server.proc is not None
    process = psutil.Process(server.proc.pid)
    hang_up_rounds(server, ROUNDS)  # warm-up: whatever the first ones allocate once
    serves(server)
    counted = disconnects(server)
    rss, fds = process.memory_info().rss, process.num_fds()

    hang_up_rounds(server, SOAK_ROUNDS)
    wait_until(lambda: disconnects(server) - counted == SOAK_ROUNDS, "every disconnect counted")
    wait_until(lambda: process.num_fds() <= fds + FD_SLACK, "connections closed")
    serves(server)
    grown = process.memory_info().rss - rss
    assert grown < RSS_GROWTH_BOUND, f"RSS grew {grown / 2**20:.1f} MiB"
    assert "Traceback" not in server.output()
