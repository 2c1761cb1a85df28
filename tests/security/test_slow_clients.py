"""Slow, silent and oversized HTTP clients are bounded: a head that does not arrive in time gets
408 (or a close when nothing was sent), a stalled body 408, a head over the limit 431 without
being read, and connections past the limit close the longest-idle one or get 503. After each, a
normal request is answered and the server's open fds and RSS are back within a bound."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from serving import ServerProcess
from testmodels import reference_output

# Slow: clients that wait out the server's timeouts.
pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
KEEPALIVE_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 16384
MAX_CONNECTIONS = 8
FD_SLACK = 3
"""Open fds the server may have above its baseline once a case is over."""
RSS_SLACK = 24 << 20
"""RSS the server may have grown by after a case (a 64 MB header read whole would not fit)."""
ON_TIME_S = 1.5
"""How late after its limit a timed-out connection may be closed (2 shared cores, loaded)."""


@dataclass
class Usage:
    fds: int
    rss: int


def usage(server: ServerProcess) -> Usage:
    assert server.proc is not None
    process = psutil.Process(server.proc.pid)
    return Usage(process.num_fds(), process.memory_info().rss)


EXPECTED = reference_output(np.full((1, 8), 0.5, np.float32))[0]


def alive(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/tiny", json=[0.5] * 8)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), EXPECTED, atol=1e-5)


def measured(server: ServerProcess) -> Usage:
    """The server's usage after a normal request: the baseline of one case."""
    alive(server)
    return usage(server)


def settled(server: ServerProcess, baseline: Usage) -> None:
    """A normal request is answered; open fds return to the baseline (polled with a deadline)
    and RSS stays within RSS_SLACK of it."""
    alive(server)
    deadline = time.monotonic() + 10
    while (now := usage(server)).fds > baseline.fds + FD_SLACK:
        assert time.monotonic() < deadline, f"fds {now.fds}, baseline {baseline.fds}"
        time.sleep(0.05)
    assert now.rss <= baseline.rss + RSS_SLACK, (now.rss, baseline.rss)


def start(store: Path, **settings: object) -> ServerProcess:
    env = {f"SCRIPTSERVE_{k.upper()}": str(v) for k, v in settings.items()}
    return ServerProcess(store, "--workers", "1", env=env).start()


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = start(
        store,
        http_header_timeout_s=HEADER_TIMEOUT_S,
        http_keepalive_timeout_s=KEEPALIVE_TIMEOUT_S,
        http_body_timeout_s=BODY_TIMEOUT_S,
        http_max_header_bytes=MAX_HEADER_BYTES,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def crowded(store: Path) -> Iterator[ServerProcess]:
    """A server with few connections, and timeouts long enough to hold them."""
    proc = start(store, http_max_connections=MAX_CONNECTIONS, http_header_timeout_s=60)
    yield proc
    proc.stop()


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.ports[0]), timeout=15)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def read_answer(sock: socket.socket) -> Answer | None:
    """One HTTP/1.1 response (Content-Length framed) from `sock`; None if it closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return Answer(int(lines[0].split()[1]), headers, body)


def closed(sock: socket.socket) -> bool:
    """True once the server has closed `sock` (EOF or reset) and sent nothing more."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def assert_error(answer: Answer | None, status: int, *words: str) -> None:
    assert answer is not None, "closed without an answer"
    assert answer.status == status, answer
    assert answer.headers["connection"] == "close"
    message = json.loads(answer.body)["message"]
    for word in words:
        assert word in message


def ping(extra_headers: bytes = b"") -> bytes:
    return b"GET /ping HTTP/1.1\r\nHost: x\r\n" + extra_headers + b"\r\n"


def timed(sock: socket.socket) -> tuple[Answer | None, float]:
    began = time.monotonic()
    answer = read_answer(sock)
    return answer, time.monotonic() - began


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(
    server: ServerProcess,
) -> None:
    baseline = measured(server)
    began = time.monotonic()
    with connect(server) as sock:
        assert closed(sock)
        waited = time.monotonic() - began
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + ON_TIME_S, waited
    settled(server, baseline)


@pytest.mark.parametrize(
    "partial",
    [b"GET /pi", b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: yes\r\n"],
    ids=["half-a-request-line", "headers-without-their-end"],
)
def test_an_incomplete_head_gets_408_on_time(server: ServerProcess, partial: bytes) -> None:
    baseline = measured(server)
    with connect(server) as sock:
        sock.sendall(partial)
        answer, waited = timed(sock)
        assert_error(answer, 408, "did not arrive within 1 s")
        assert closed(sock)
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + ON_TIME_S, waited
    settled(server, baseline)


def test_on_a_keep_alive_connection_the_header_timeout_starts_at_the_first_byte(
    server: ServerProcess,
) -> None:
    baseline = measured(server)
    with connect(server) as sock:
        sock.sendall(ping())
        first = read_answer(sock)
        assert first is not None and first.status == 200
        assert first.headers.get("connection") != "close"
        sock.sendall(b"GET /ping HTTP/1.1\r\n")
        answer, waited = timed(sock)
        assert_error(answer, 408)
    assert HEADER_TIMEOUT_S * 0.9 <= waited <= HEADER_TIMEOUT_S + ON_TIME_S, waited
    settled(server, baseline)


def test_a_keep_alive_connection_idle_for_the_keepalive_timeout_is_closed(
    server: ServerProcess,
) -> None:
    """Each answer starts the connection's idle time again: requests sent at shorter intervals
    keep it open past the timeout; once it waits longer than that, the server closes it."""
    baseline = measured(server)
    with connect(server) as sock, connect(server) as other:
        began = time.monotonic()
        for _ in range(3):
            sock.sendall(ping())
            answer = read_answer(sock)
            assert answer is not None and answer.status == 200
            other.sendall(ping())  # another idle connection, on its own clock
            assert read_answer(other) is not None
            time.sleep(KEEPALIVE_TIMEOUT_S * 0.6)
        assert time.monotonic() - began > KEEPALIVE_TIMEOUT_S
        rested = time.monotonic()
        assert closed(sock)
        waited = time.monotonic() - rested + KEEPALIVE_TIMEOUT_S * 0.6
        assert closed(other)
    assert KEEPALIVE_TIMEOUT_S * 0.9 <= waited <= KEEPALIVE_TIMEOUT_S + ON_TIME_S, waited
    settled(server, baseline)


def test_headers_without_their_body_get_408_at_the_body_timeout(server: ServerProcess) -> None:
    baseline = measured(server)
    body = json.dumps([0.5] * 8).encode()
    head = (
        b"POST /predictions/tiny HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with connect(server) as sock:
        sock.sendall(head + body[:5])
        answer, waited = timed(sock)
        assert_error(answer, 408, "request body stalled")
        assert closed(sock)
    assert BODY_TIMEOUT_S * 0.9 <= waited <= BODY_TIMEOUT_S + ON_TIME_S, waited
    assert "Traceback" not in server.output()
    settled(server, baseline)


def test_a_body_slower_in_total_than_the_body_timeout_but_never_idle_that_long_is_served(
    server: ServerProcess,
) -> None:
    baseline = measured(server)
    """The body timeout is idle time between reads (nginx), not the whole transfer."""
    body = json.dumps([0.5] * 8).encode()
    head = (
        b"POST /predictions/tiny HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    parts = [body[i : i + 8] for i in range(0, len(body), 8)]
    pause = BODY_TIMEOUT_S * 0.4  # the client's pace: the behaviour under test
    assert pause * (len(parts) - 1) > BODY_TIMEOUT_S * 1.5
    with connect(server) as sock:
        sock.sendall(head)
        for part in parts:
            time.sleep(pause)
            sock.sendall(part)
        answer = read_answer(sock)
        assert answer is not None and answer.status == 200, answer
        np.testing.assert_allclose(json.loads(answer.body), EXPECTED, atol=1e-5)
    settled(server, baseline)


def send_until_refused(sock: socket.socket, head: bytes, filler_bytes: int) -> int:
    """Send `head` then up to `filler_bytes` of header value; returns the bytes sent before the
    server stopped taking them (closed, or stopped reading for 2 s)."""
    sent = 0
    sock.settimeout(2)
    chunk = b"a" * 65536
    try:
        sock.sendall(head)
        sent += len(head)
        while sent < filler_bytes:
            sent += sock.send(chunk)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    sock.settimeout(15)
    return sent


def bytes_read(server: ServerProcess) -> int:
    """Bytes the server process has read so far, sockets included (/proc/PID/io rchar)."""
    assert server.proc is not None
    return int(psutil.Process(server.proc.pid).io_counters().read_chars)


def test_a_64_mb_header_gets_431_without_being_read(server: ServerProcess) -> None:
    baseline = measured(server)
    total = 64 << 20
    before = bytes_read(server)
    with connect(server) as sock:
        sent = send_until_refused(sock, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: ", total)
        answer = read_answer(sock)
        assert_error(answer, 431, str(MAX_HEADER_BYTES))
        assert closed(sock)
    read = bytes_read(server) - before
    # The server read the limit and what it dropped while lingering (1 MiB), in reads of up to
    # 256 KiB, and then closed; the rest never left the kernel's buffers or the client.
    assert read < 2 << 20, read
    assert sent < total, sent
    settled(server, baseline)


def padded_head(size: int) -> bytes:
    """A GET /ping head of exactly `size` bytes."""
    bare = ping(b"X-Pad: \r\n")
    return ping(b"X-Pad: " + b"p" * (size - len(bare)) + b"\r\n")


def test_a_head_at_the_limit_is_served_and_one_byte_over_gets_431(server: ServerProcess) -> None:
    baseline = measured(server)
    with connect(server) as sock:
        sock.sendall(padded_head(MAX_HEADER_BYTES))
        answer = read_answer(sock)
        assert answer is not None and answer.status == 200, answer
    with connect(server) as sock:
        sock.sendall(padded_head(MAX_HEADER_BYTES + 1))
        assert_error(read_answer(sock), 431, "larger than the server's limit")
        assert closed(sock)
    settled(server, baseline)


def test_idle_connections_at_the_limit_do_not_starve_serving(crowded: ServerProcess) -> None:
    baseline = measured(crowded)
    # Connections that never send a byte.
    silent = [connect(crowded) for _ in range(MAX_CONNECTIONS)]
    try:
        alive(crowded)  # the server accepts in order: this one finds the limit reached
        assert closed(silent[0]), "the longest-idle connection was not the one closed"
    finally:
        for sock in silent:
            sock.close()
    # Keep-alive connections between requests (each answered, so marked idle, in this order).
    kept = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = connect(crowded)
            sock.sendall(ping())
            answer = read_answer(sock)
            assert answer is not None and answer.status == 200
            kept.append(sock)
        alive(crowded)
        assert closed(kept[0])
        kept[1].sendall(ping())  # the others are still open and serve
        answer = read_answer(kept[1])
        assert answer is not None and answer.status == 200
    finally:
        for sock in kept:
            sock.close()
    settled(crowded, baseline)


def test_at_the_limit_with_no_idle_connection_a_new_one_gets_503(crowded: ServerProcess) -> None:
    baseline = measured(crowded)
    body = json.dumps([0.5] * 8).encode()
    head = (
        b"POST /predictions/tiny HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    busy = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = connect(crowded)
            sock.sendall(head)
            # The app waits for the body: the request is in progress, the connection not idle.
            assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            busy.append(sock)
        with connect(crowded) as sock:
            sock.sendall(ping())
            answer = read_answer(sock)
            assert_error(answer, 503, "too many open connections")
            assert answer is not None and answer.headers["retry-after"] == "1"
            assert closed(sock)
        for sock in busy:  # every request in progress was kept, and is answered
            sock.sendall(body)
            answer = read_answer(sock)
            assert answer is not None and answer.status == 200, answer
    finally:
        for sock in busy:
            sock.close()
    settled(crowded, baseline)
