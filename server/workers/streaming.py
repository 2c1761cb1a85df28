"""Answers that come in parts: from a worker thread to the transport writing them to a client.

A request whose client takes a stream (REST `/predictions`, OIP `generate_stream`, gRPC
`StreamPredictions` and `ModelStreamInfer`) is queued with a `PartStream`. The worker running
its batch offers each part the handler yields (`JobParts`, one per batch); the transport reads
them in order with `next`, the request's future bringing the end (its final part, or an empty
one) or the error that ended it.

A stream's memory is bounded: at most `max_unread` parts may wait for a client that reads
slowly; one more and the stream is ended with `StreamOverrun` (429 / RESOURCE_EXHAUSTED) and
the worker stops producing for it. A client that goes away, or whose deadline passes (the
request's deadline covers the whole stream), ends its stream the same way; once no request of
a batch listens, `JobParts.send` raises `StreamClosed` into the handler and the worker is free.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from scriptserve.handlers.base import InferenceResponse, StreamClosed
from scriptserve.server.errors import InvalidInput, ServingError, StreamOverrun

T = TypeVar("T")


class PartStream(Generic[T]):
    """One request's answer, part by part. `offer` runs on the worker's thread; everything
    else on the event loop. `answer` turns a response into what the transport encodes."""

    def __init__(
        self,
        future: asyncio.Future[InferenceResponse],
        max_unread: int,
        answer: Callable[[InferenceResponse], T],
        model: tuple[str, str] = ("", ""),
        streaming: bool = False,
    ) -> None:
        self.model_name, self.model_version = model
        self.streaming = streaming
        """The model declares that it answers in parts (its handler implements `stream`)."""
        self.future = future
        self.max_unread = max_unread
        self.ended = False
        """`next` has returned the stream's end (its last part, or None)."""
        self._answer = answer
        self._loop = future.get_loop()
        self._parts: deque[InferenceResponse] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.on_part: Callable[[], None] | None = None
        """Called once, on the loop, when the first part arrives: a transport that takes a
        one-piece answer from the future's callback (no coroutine per request) starts reading
        the stream with `next` then."""
        # Each counter is written by one thread only: `offered` by the worker, `taken` by the
        # loop; their difference is what waits unread.
        self._offered = 0
        self._taken = 0
        self._watching = False
        """`_wake` is one of the future's callbacks: added when `next` first waits, not per
        request (most answers come in one piece, taken from the future's own callback)."""

    @property
    def parts_sent(self) -> int:
        """Parts handed to the transport so far."""
        return self._taken

    # -- the worker's side -------------------------------------------------------------------
    def offer(self, part: InferenceResponse) -> bool:
        """Queue a part for the client; False when the client is gone or too far behind (the
        stream is then ended with StreamOverrun)."""
        if self.future.done():
            return False
        if self._offered - self._taken >= self.max_unread:
            self._loop.call_soon_threadsafe(self._overrun)
            return False
        self._offered += 1
        self._loop.call_soon_threadsafe(self._push, part)
        return True

    # -- the loop's side ---------------------------------------------------------------------
    def _push(self, part: InferenceResponse) -> None:
        if not self.future.done():
            self._parts.append(part)
            self._wake()
            if self.on_part is not None:
                on_part, self.on_part = self.on_part, None
                on_part()

    def _overrun(self) -> None:
        if not self.future.done():
            self.future.set_exception(
                StreamOverrun(
                    f"the client read the stream too slowly: {self.max_unread} parts waited "
                    "unread, so the stream was ended; read parts as they come"
                )
            )

    def _wake(self, _future: object = None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> T | None:
        """The next part; at the end, the request's last part if it carries anything, then
        None. Raises the ServingError that ended the stream (after the parts before it)."""
        while True:
            if self._parts:
                self._taken += 1
                return self._answer(self._parts.popleft())
            if self.future.done():
                if self.ended:
                    return None
                self.ended = True
                last = self.future.result()
                return None if last.empty else self._answer(last)
            if not self._watching:
                self._watching = True
                self.future.add_done_callback(self._wake)
            self._waiter = self._loop.create_future()
            await self._waiter

    def result(self) -> T | None:
        """The answer of a stream that ended before any part came (its future done, nothing
        queued), at once: its last part, or None when that is empty. Raises what ended it."""
        self.ended = True
        last = self.future.result()
        return None if last.empty else self._answer(last)

    def close(self) -> None:
        """The client went away: stop its parts (the worker notices at its next step)."""
        self.future.cancel()


class StreamRefused(InvalidInput):
    """A model answers in parts; the request takes one answer."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"model {model!r} answers in parts: call a streaming endpoint (POST "
            f"/predictions/{model}, POST /v2/models/{model}/generate_stream, gRPC "
            "StreamPredictions or ModelStreamInfer)"
        )


class JobParts:
    """The `PartSink` of one batch: each part goes to its request's stream.

    `streams[i]` is request i's PartStream, or None when its client takes one answer (a part
    for it fails it with StreamRefused). A part marked final ends its request at once.
    `finish(i, response)` answers request i from the worker's thread.
    """

    def __init__(
        self,
        futures: Sequence[asyncio.Future[InferenceResponse]],
        streams: Sequence[PartStream[object] | None],
        finish: Callable[[int, InferenceResponse | ServingError], None],
        model: str,
    ) -> None:
        self._futures = futures
        self._streams = streams
        self._finish = finish
        self._model = model
        self._ended = [False] * len(futures)

    def send(self, parts: Sequence[InferenceResponse | None]) -> None:
        if len(parts) != len(self._futures):
            raise ValueError(
                f"{len(parts)} parts were sent for a batch of {len(self._futures)} requests; "
                "send one part (or None) per request"
            )
        listening = False
        for i, part in enumerate(parts):
            if self._ended[i] or self._futures[i].done():
                continue
            stream = self._streams[i]
            if part is None:
                listening = True
            elif stream is None:
                self._ended[i] = True
                self._finish(i, StreamRefused(self._model))
            elif part.final:
                self._ended[i] = True
                self._finish(i, part)
            elif stream.offer(part):
                listening = True
            else:
                self._ended[i] = True
        if not listening:
            raise StreamClosed()
