"""Scenario A's ceiling: the same HTTP stack with nothing above it.

    python -m uvicorn benchmarks.baselines.raw_asgi:app --loop uvloop --http httptools --port 9000

A plain ASGI callable (no framework, no routing, no middleware) that reads the whole body,
parses it with orjson and answers ten numbers: what one Python process on uvicorn + uvloop +
httptools can do for scenario A's request before any serving work. `GET /` answers "ok".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_ANSWER = orjson.dumps([0.0] * 10)
_JSON_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_ANSWER))]
_OK = b"ok"
_TEXT_HEADERS = [(b"content-type", b"text/plain"), (b"content-length", b"2")]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":
        await send({"type": "http.response.start", "status": 200, "headers": _TEXT_HEADERS})
        await send({"type": "http.response.body", "body": _OK})
        return
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    orjson.loads(b"".join(chunks))
    await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
    await send({"type": "http.response.body", "body": _ANSWER})
