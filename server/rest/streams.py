"""Answers in parts over the ASGI app: Triton's generate extension (`/generate` for one answer,
`/generate_stream` as Server-Sent Events). TorchServe's chunked `/predictions` is written by the
HTTP protocol (`route_cycles.py:PredictionCycle`), by the same rules.

The status line waits for the first part: a request that fails before it is answered with its
error status, as every other route answers (Triton's generate does the same). Later errors end
the stream with an error part: TorchServe's `{"code", "type", "message"}` chunk, or a
`data: {"error": ...}` event. A client that hangs up ends its stream: the worker stops
generating for it at its next step (while waiting for the first part too, for models that
declare they stream).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.codec import generate
from scriptserve.server.errors import ServingError
from scriptserve.server.inference.decoding import Served
from scriptserve.server.workers.streaming import PartStream

log = logging.getLogger("scriptserve.rest.streams")


def log_stream_end(stream: PartStream[Served], error: ServingError) -> None:
    """A stream that failed after its first part: the client sees an error part, the log this."""
    log.info(
        "model=%s version=%s stream ended after %d parts: %s",
        stream.model_name,
        stream.model_version,
        stream.parts_sent,
        error.message,
    )


Stream = PartStream[Served]


class ClientGone(Exception):
    """The client hung up before the first part of its answer."""


async def _first(stream: Stream, request: Request) -> Served | None:
    """The stream's first part; for a model that streams, also watch the client meanwhile (its
    body is read, so the next receive is its disconnect)."""
    if not stream.streaming:
        return await stream.next()
    part = asyncio.ensure_future(stream.next())
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((part, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not part.done():
            part.cancel()
    if not part.done() or part.cancelled():
        raise ClientGone
    return part.result()


async def _disconnect(request: Request) -> None:
    """Return once the client has hung up (its body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _rest(
    stream: Stream,
    first: bytes,
    encode: Callable[[Served], bytes],
    failed: Callable[[ServingError], bytes],
) -> AsyncIterator[bytes]:
    """The body after the status line: `first`, each further part, an error part if one ends
    the stream. Closing the iterator (the client hung up) ends the stream."""
    try:
        yield first
        while (served := await stream.next()) is not None:
            yield encode(served)
    except ServingError as exc:
        log_stream_end(stream, exc)
        yield failed(exc)
    finally:
        stream.close()


async def answer(
    stream: Stream,
    request: Request,
    encode: Callable[[Served], tuple[bytes, int, dict[str, str] | None, str]],
    media_type: str | None,
    failed: Callable[[ServingError], bytes],
) -> Response:
    """The HTTP answer of a stream: one response when the answer came in one piece, else a
    streamed body (`media_type`, or the first part's own) of one encoded part after another."""
    try:
        first = await _first(stream, request)
    except ClientGone:
        stream.close()
        return Response(status_code=499)  # nobody reads it; the access log records the status
    except BaseException:
        stream.close()
        raise
    if first is None:  # an empty answer in one piece
        first = Served(stream.model_name, stream.model_version, InferenceResponse())
    payload, status, headers, content_type = encode(first)
    if stream.ended:
        return Response(payload, status, headers=headers, media_type=content_type)
    body = _rest(stream, payload, lambda served: encode(served)[0], failed)
    return StreamingResponse(body, status, headers=headers, media_type=media_type or content_type)


def _generate(served: Served) -> bytes:
    return generate.generate_response(served.model_name, served.model_version, served.response)


def _event(served: Served) -> tuple[bytes, int, dict[str, str] | None, str]:
    return generate.event(_generate(served)), 200, None, "text/event-stream"


def _failed_event(exc: ServingError) -> bytes:
    return generate.event(generate.error_json(exc))


async def generate_stream_answer(stream: Stream, request: Request) -> Response:
    """Triton's `/generate_stream`: each part as a Server-Sent Event."""
    return await answer(stream, request, _event, "text/event-stream; charset=utf-8", _failed_event)


def generate_answer(served: Served) -> Response:
    """Triton's `/generate`: one answer as JSON."""
    return Response(_generate(served), media_type="application/json")
