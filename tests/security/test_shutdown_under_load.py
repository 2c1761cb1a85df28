"""SIGTERM while 32 keep-alive clients hammer the server: no request is left without an answer.

Each client is a raw HTTP/1.1 connection that sends its next request as soon as the last answer
arrives, and reconnects when told `Connection: close`. A request counts as answered with any
status; a reset or a close after it was sent counts as unanswered; a refused new connection
carries no request and ends that client. Every answer must be a 200: what reached the server
was run.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from serving import ServerProcess
from testmodels import reference_output

# Slow: servers drained under load.
pytestmark = pytest.mark.slow

CLIENTS = 32
WARM_ANSWERS = 10
"""Answers every client has had before SIGTERM: all 32 are hammering by then."""


@dataclass
class Tally:
    sent: int = 0
    unanswered: int = 0
    refused: int = 0
    refused_while_running: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    wrong_outputs: int = 0
    after_signal: list[tuple[int, bool]] = field(default_factory=list)
    """(status, Connection: close?) of every answer read after SIGTERM was sent."""


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


async def hammer(
    server: ServerProcess,
    request: bytes,
    tally: Tally,
    signalled: asyncio.Event,
    answers: list[int],
    slot: int,
    expected: list[float] | None,
) -> None:
    assert server.proc is not None
    writer: asyncio.StreamWriter | None = None
    while True:
        if writer is None:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
            except OSError:
                tally.refused += 1  # the listener is closed: nothing was sent
                tally.refused_while_running += server.proc.poll() is None
                return
        writer.write(request)
        tally.sent += 1
        try:
            status, headers, answer = await read_answer(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            tally.unanswered += 1
            writer.close()
            writer = None
            continue
        answers[slot] += 1
        tally.statuses[status] += 1
        close = headers.get("connection") == "close"
        if signalled.is_set():
            tally.after_signal.append((status, close))
        if (
            status == 200
            and expected is not None
            and not np.allclose(json.loads(answer), expected, atol=1e-5)
        ):
            tally.wrong_outputs += 1
        if close:
            writer.close()
            writer = None


def test_sigterm_under_32_keep_alive_clients_leaves_no_request_unanswered(
    store: Path,
) -> None:
    server = ServerProcess(store, "--workers", "2", "--drain-timeout", "20").start()
    assert server.proc is not None
    x = np.full((1, 8), 0.5, np.float32)
    expected = reference_output(x)[0].tolist()
    body = json.dumps(x[0].tolist()).encode()
    infer = (
        b"POST /predictions/tiny HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    ready_probe = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    tally, probe = Tally(), Tally()

    async def run() -> None:
        signalled = asyncio.Event()
        answers = [0] * (CLIENTS + 1)
        tasks = [
            asyncio.create_task(hammer(server, infer, tally, signalled, answers, i, expected))
            for i in range(CLIENTS)
        ]
        # Readiness on a keep-alive connection of its own: 200 until SIGTERM, then 503.
        ready = asyncio.create_task(
            hammer(server, ready_probe, probe, signalled, answers, CLIENTS, None)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while min(answers) < WARM_ANSWERS:
            assert loop.time() < deadline, f"clients never got going: {answers}"
            assert not any(t.done() for t in [*tasks, ready]), "a client ended early"
            await asyncio.sleep(0.01)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        signalled.set()
        done, pending = await asyncio.wait([*tasks, ready], timeout=60)
        assert not pending, "clients still running 60 s after SIGTERM"
        for task in done:
            task.result()

    began = time.monotonic()
    try:
        asyncio.run(run())
        code = server.terminate(60)
    finally:
        server.stop()
    log = server.output()
    assert code == 0, log
    assert tally.unanswered == 0, f"{tally.unanswered} of {tally.sent} requests unanswered"
    assert probe.unanswered == 0
    # Every client ended on a refused connection, told to reconnect by `Connection: close`;
    # the listeners closed while the server still drained.
    assert tally.refused == CLIENTS and probe.refused == 1
    assert tally.refused_while_running > 0
    assert log.index("HTTP listeners closed") < log.index("scriptserve.app: stopped")
    # A request that reached the server on an open connection was run, not refused: the
    # clients never saw a 503 (the listeners closed, and the keep-alive grace served the rest).
    assert set(tally.statuses) == {200}, tally.statuses
    assert tally.wrong_outputs == 0
    # While draining every answer says Connection: close (a 200 may predate the signal's arrival).
    for status, close in tally.after_signal + probe.after_signal:
        assert close or status == 200, (status, close)
    # Readiness: 200s, then 503 (with close) and never 200 again.
    ready = [status for status, _ in probe.after_signal]
    assert ready and ready[-1] == 503, ready
    assert 200 not in ready[ready.index(503) :], ready
    assert "Traceback" not in log
    assert time.monotonic() - began < 30


def test_a_request_on_an_open_connection_during_the_drain_is_served(store: Path) -> None:
    """After SIGTERM, a keep-alive client's next request (sent before it could know) is run
    and answered 200 with `Connection: close`, not refused; a new connection is refused."""
    server = ServerProcess(store, "--workers", "1", "--drain-keepalive-grace-s", "5").start()
    assert server.proc is not None
    x = np.full((1, 8), 0.5, np.float32)
    body = json.dumps(x[0].tolist()).encode()
    infer = (
        b"POST /predictions/tiny HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    async def run() -> tuple[int, dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
        writer.write(infer)
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers.get("connection") != "close"
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while "HTTP listeners closed" not in server.output():
            assert loop.time() < deadline, server.output()
            await asyncio.sleep(0.02)
        with pytest.raises(OSError):  # the listener is closed
            await asyncio.open_connection("127.0.0.1", server.ports[0])
        writer.write(infer)  # the same keep-alive connection, within the grace
        answer = await read_answer(reader)
        writer.close()
        return answer

    try:
        status, headers, answer = asyncio.run(run())
        code = server.terminate(60)
    finally:
        server.stop()
    assert status == 200, answer
    assert headers.get("connection") == "close"
    assert np.allclose(json.loads(answer), reference_output(x)[0], atol=1e-5)
    assert code == 0
