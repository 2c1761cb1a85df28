"""Scenario A's request below ASGI: the raw-ASGI ceiling's work on httptools and uvloop alone.

    python -m benchmarks.baselines.httptools_echo --port 9000

An asyncio protocol that parses HTTP/1.1 with httptools and answers from the parser's callback:
no ASGI scope, no task and no message dicts per request. It reads the body, parses it with
orjson and answers ten numbers (`GET` answers "ok"), keep-alive only. It is what an HTTP
protocol of scriptserve's own for the inference routes could at best cost per request, beside
`raw_asgi.py` (the same work through uvicorn's ASGI cycle); it has none of the limits a server
needs (timeouts, sizes, pipelining order, chunked answers) and is a measuring stick only.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import httptools
import orjson
import uvloop

_ANSWER = orjson.dumps([0.0] * 10)
_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_ANSWER),
    _ANSWER,
)
_OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


class Echo(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.parser.get_method() == b"GET":
            self.transport.write(_OK)
            return
        orjson.loads(b"".join(self.body))
        self.body = []
        self.transport.write(_JSON)


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Echo, "127.0.0.1", port, backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.baselines.httptools_echo")
    p.add_argument("--port", type=int, required=True)
    uvloop.run(serve(p.parse_args().port))


if __name__ == "__main__":
    main()
