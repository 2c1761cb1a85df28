"""The raw-ASGI ceiling's work behind a front end that parses HTTP outside Python.

    pip install granian   # not a dependency of scriptserve: this is a measuring stick
    granian --interface rsgi --workers 1 --runtime-threads 1 --loop uvloop --port 9000 \\
        benchmarks.baselines.granian_rsgi:app

granian (Rust, hyper) reads and writes HTTP on its own threads and calls this RSGI app on a
Python event loop with the request's body already read: it reads the body, parses it with
orjson and answers ten numbers, as `raw_asgi.py` does through uvicorn's ASGI cycle. `GET`
answers "ok". `benchmarks/front_ends.py` loads both in turn.
"""

from __future__ import annotations

from typing import Any

import orjson

_ANSWER = orjson.dumps([0.0] * 10)
_JSON = [("content-type", "application/json")]
_TEXT = [("content-type", "text/plain")]


async def app(scope: Any, protocol: Any) -> None:
    if scope.proto != "http":
        return
    if scope.method == "GET":
        protocol.response_bytes(200, _TEXT, b"ok")
        return
    orjson.loads(await protocol())
    protocol.response_bytes(200, _JSON, _ANSWER)
