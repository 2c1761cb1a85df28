"""No input can forge a log line: a newline in a registered model name or in an OIP request id
(REST and gRPC), logged when a handler fails or a process worker dies, reaches the server's log
escaped (`\\n`), in the server and in its worker processes; tracebacks keep their line breaks.
The formatter itself is checked in-process."""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from hardening import archive
from serving import ServerProcess
from tritonclient.utils import InferenceServerException

from scriptserve.server.observability.log_format import (
    LOG_FORMAT,
    EscapingFormatter,
    escape_controls,
)

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

FORGED = "FORGED 2026-01-01 00:00:00,000 CRITICAL scriptserve.app: forged line"
RAISE, KILL = 4567.0, 3456.0

VICTIM_HANDLER = """
import os
import signal

from scriptserve.handlers.tensor import TensorHandler


class Victim(TensorHandler):
    def handle(self, requests, context):
        for request in requests:
            x = request.inputs.get("x")
            code = float(x.flat[0]) if x is not None and x.size else 0.0
            if code == 4567.0:
                # The request id (the client's) in the exception's message, as handlers do.
                raise RuntimeError(f"cannot serve request {request.request_id}")
            if code == 3456.0:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().handle(requests, context)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("log_injection")
    store, work = root / "store", root / "work"
    handler = root / "victim_handler.py"
    handler.write_text(VICTIM_HANDLER)
    archive(store, work, "tiny")
    archive(store, work, "victim_thread", handler=str(handler), config={"batchSize": 1})
    archive(
        store,
        work,
        "victim_process",
        handler=str(handler),
        config={"batchSize": 1, "workerMode": "process"},
    )
    (store / "broken.mar").write_bytes(b"not a zip archive at all")
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--enable-model-api",
        "--no-snapshot",
        "--models",
        "tiny.mar",
        "victim_thread.mar",
        "victim_process.mar",
        env={"SCRIPTSERVE_WORKER_RESTART_BACKOFF_S": "0.2"},
    ).start(timeout_s=120)
    yield proc
    proc.stop()


def assert_not_forged(log: str, *starts: str) -> None:
    """No line of `log` starts with the forged text (or any of `starts`)."""
    for line in log.splitlines():
        for start in (FORGED, *starts):
            assert not line.startswith(start), f"forged log line: {line!r}"


def wait_for_log(server: ServerProcess, text: str, timeout_s: float = 30.0) -> str:
    """The server's log once it holds `text`."""
    server.wait(lambda _: text in server.output(), timeout_s)
    return server.output()


def v2_infer(server: ServerProcess, model: str, request_id: str, code: float) -> httpx.Response:
    data = [code] + [0.0] * 7
    body: dict[str, Any] = {
        "id": request_id,
        "inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": data}],
    }
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)


def test_a_model_name_with_a_newline_forges_no_line(server: ServerProcess) -> None:
    mgmt, headers = server.mgmt, server.mgmt_headers
    # An archive that does not open: the name the client chose is logged with the failure.
    name = f"evil\n{FORGED}"
    r = httpx.post(
        f"{mgmt}/models", params={"url": "broken.mar", "model_name": name}, headers=headers
    )
    assert r.status_code == 400, r.text
    log = wait_for_log(server, f"model=evil\\n{FORGED}")
    assert_not_forged(log)

    # A name that ends in a newline: refused or registered, its log lines stay whole.
    r = httpx.post(
        f"{mgmt}/models",
        params={"url": "tiny.mar", "model_name": "tiny2\n"},
        headers=headers,
        timeout=60,
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        wait_for_log(server, "model=tiny2\\n version=1.0 loaded")
        r = httpx.delete(f"{mgmt}/models/tiny2%0A", headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    assert_not_forged(server.output(), " version=")


@pytest.mark.parametrize("model", ["victim_thread", "victim_process"])
def test_a_request_id_with_a_newline_in_a_failing_request_forges_no_line(
    server: ServerProcess, model: str
) -> None:
    r = v2_infer(server, model, f"rest-{model}\n{FORGED}", RAISE)
    assert r.status_code == 500, r.text
    # The id reaches the log twice: in the message and in the traceback's exception line.
    log = wait_for_log(server, f"RuntimeError: cannot serve request rest-{model}\\n{FORGED}")
    assert f"request_ids=rest-{model}\\n{FORGED}" in log
    assert "Traceback (most recent call last):\n" in log  # tracebacks keep their lines

    client = triton.InferenceServerClient(server.grpc)
    tensor = triton.InferInput("x", [1, 8], "FP32")
    tensor.set_data_from_numpy(np.array([[RAISE] + [0.0] * 7], dtype=np.float32))
    with pytest.raises(InferenceServerException, match="RuntimeError"):
        client.infer(model, [tensor], request_id=f"grpc-{model}\n{FORGED}")
    client.close()
    log = wait_for_log(server, f"request_ids=grpc-{model}\\n{FORGED}")
    assert_not_forged(log)


def test_a_request_id_with_a_newline_on_a_dying_process_worker_forges_no_line(
    server: ServerProcess,
) -> None:
    r = v2_infer(server, "victim_process", f"dies\n{FORGED}", KILL)
    assert r.status_code == 503, r.text
    assert "died (killed by signal 9 (SIGKILL))" in r.json()["error"]
    log = wait_for_log(server, f"request_ids=dies\\n{FORGED} worker")
    assert_not_forged(log)
    # The worker is replaced and serves again.
    server.wait(
        lambda c: c.get(f"{server.url}/v2/models/victim_process/ready").status_code == 200, 60
    )
    assert v2_infer(server, "victim_process", "fine", 0.0).status_code == 200


# -- the formatter, in-process ------------------------------------------------------------------


def formatted(emit: Any) -> str:
    """What `emit(logger)` writes through an EscapingFormatter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    logger = logging.getLogger("scriptserve.tests.log_format")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return out.getvalue()


RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ scriptserve\.tests\.log_format: "
)


def test_the_formatter_escapes_every_control_character_of_the_message() -> None:
    hostile = "a\nb\rc\td\x1b[31me\x00f\x7fg\x85h\u2028i\u2029j"
    text = formatted(lambda log: log.warning("model=%s id=%s", hostile, "x\r\nFORGED"))
    assert text.count("\n") == 1 and RECORD.match(text)
    assert text.endswith(
        "model=a\\nb\\rc\\td\\x1b[31me\\x00f\\x7fg\\x85h\\u2028i\\u2029j id=x\\r\\nFORGED\n"
    )
    assert escape_controls("plain text, é and ü") == "plain text, é and ü"


def test_no_character_that_ends_or_breaks_a_line_skips_the_escaping() -> None:
    """A text Python calls printable is returned as it is (the access log's fast path): every
    character of the Basic Multilingual Plane and the next plane, alone and inside printable
    text, is escaped exactly as the full translation escapes it."""
    table = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
    table.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
    table.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
    for code in range(0x20000):
        if 0xD800 <= code <= 0xDFFF:
            continue  # surrogates are not characters
        text = f"model=m{chr(code)}x"
        assert escape_controls(text) == text.translate(table), hex(code)


def test_the_formatter_keeps_traceback_lines_and_escapes_exception_messages() -> None:
    def emit(log: logging.Logger) -> None:
        try:
            try:
                raise ValueError(f"inner\n{FORGED}")
            except ValueError as exc:
                raise RuntimeError(f"outer\r\n{FORGED}") from exc
        except RuntimeError:
            log.exception("request_ids=%s failed", f"r\n{FORGED}")

    text = formatted(emit)
    lines = text.splitlines()
    assert RECORD.match(lines[0]) and lines[0].endswith(f"request_ids=r\\n{FORGED} failed")
    assert lines.count("Traceback (most recent call last):") == 2
    assert any(line.startswith('  File "') for line in lines)
    assert f"ValueError: inner\\n{FORGED}" in lines
    assert f"RuntimeError: outer\\r\\n{FORGED}" in lines
    assert "The above exception was the direct cause of the following exception:" in lines
    assert_not_forged(text)


def test_the_formatter_keeps_stack_lines() -> None:
    text = formatted(lambda log: log.error("where=%s", f"\n{FORGED}", stack_info=True))
    lines = text.splitlines()
    assert lines[0].endswith(f"where=\\n{FORGED}")
    assert lines[1] == "Stack (most recent call last):"
    assert any(line.startswith('  File "') for line in lines[2:])
    assert_not_forged(text)


def test_a_traceback_another_formatter_cached_is_formatted_again() -> None:
    def emit(log: logging.Logger) -> None:
        try:
            raise ValueError(f"cached\n{FORGED}")
        except ValueError:
            record = log.makeRecord(
                log.name, logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
            )
        logging.Formatter().format(record)  # caches the raw traceback on the record
        assert record.exc_text and f"\n{FORGED}" in record.exc_text
        log.handle(record)

    text = formatted(emit)
    assert f"ValueError: cached\\n{FORGED}" in text
    assert_not_forged(text)
