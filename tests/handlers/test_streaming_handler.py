"""The streaming handler API in-process: what `run_batch` sends to a batch's sink, what it
answers each request with, and how it stops a generation nobody listens to any more."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from scriptserve.archiver.manifest import Manifest
from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    InferenceRequest,
    InferenceResponse,
    StreamClosed,
    run_batch,
)

CONTEXT = Context(
    model_name="counter",
    model_version="1.0",
    model_dir=Path("."),
    manifest=Manifest.from_dict(
        {"model": {"modelName": "counter", "modelVersion": "1.0", "handler": "x.py"}}
    ),
)


class Recorder:
    """A sink that keeps each step; it stops listening after `listen_steps` steps."""

    def __init__(self, listen_steps: int = 1000) -> None:
        self.steps: list[list[InferenceResponse | None]] = []
        self.listen_steps = listen_steps

    def send(self, parts: Sequence[InferenceResponse | None]) -> None:
        self.steps.append(list(parts))
        if len(self.steps) >= self.listen_steps:
            raise StreamClosed()


def n(part: InferenceResponse | None) -> int | None:
    return None if part is None else int(part.outputs["n"][0])


class Counter(BaseHandler):
    """Request i counts to its `upto`; the last count is its final part."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def stream(self, requests: list[InferenceRequest]) -> Iterator[list[InferenceResponse | None]]:
        limits = [int(r.parameters["upto"]) for r in requests]
        try:
            for step in range(max(limits)):
                yield [
                    InferenceResponse(outputs={"n": np.array([step])}, final=step == upto - 1)
                    if step < upto
                    else None
                    for upto in limits
                ]
        finally:
            self.closed = True


def requests(*limits: int) -> list[InferenceRequest]:
    return [InferenceRequest(parameters={"upto": upto}) for upto in limits]


def test_each_step_goes_to_the_sink_and_final_parts_answer_their_requests() -> None:
    handler, sink = Counter(), Recorder()
    answers = run_batch(handler, requests(2, 3), CONTEXT, parts=sink)
    assert [[n(p) for p in step] for step in sink.steps] == [[0, 0], [1, 1], [None, 2]]
    assert [n(a) for a in answers] == [1, 2]
    assert all(a.final and a.error is None for a in answers)
    assert handler.closed


def test_a_generator_that_ends_ends_each_stream_with_an_empty_answer() -> None:
    class Plain(BaseHandler):
        def stream(
            self, requests: list[InferenceRequest]
        ) -> Iterator[list[InferenceResponse | None]]:
            yield [InferenceResponse(body=b"a") for _ in requests]

    (answer,) = run_batch(Plain(), requests(1), CONTEXT, parts=Recorder())
    assert answer.empty and answer.final
    assert Plain.streams() and not BaseHandler.streams()


def test_nobody_listening_closes_the_generator_at_once() -> None:
    handler, sink = Counter(), Recorder(listen_steps=2)
    answers = run_batch(handler, requests(50, 50), CONTEXT, parts=sink)
    assert len(sink.steps) == 2
    assert handler.closed
    assert {(a.status, a.error) for a in answers} == {
        (499, "no request of the batch still listens to its stream")
    }


def test_a_step_of_the_wrong_length_fails_the_batch_and_says_why() -> None:
    class Short(BaseHandler):
        def stream(
            self, requests: list[InferenceRequest]
        ) -> Iterator[list[InferenceResponse | None]]:
            yield [InferenceResponse(body=b"a")]

    answers = run_batch(Short(), requests(1, 1), CONTEXT, parts=Recorder())
    assert {a.error for a in answers} == {
        "Short.stream yielded 1 parts for a batch of 2 requests; yield a list with one part "
        "(or None) per request"
    }


def test_a_part_after_the_final_one_is_refused() -> None:
    class Again(BaseHandler):
        def stream(
            self, requests: list[InferenceRequest]
        ) -> Iterator[list[InferenceResponse | None]]:
            yield [InferenceResponse(body=b"a", final=True) for _ in requests]
            yield [InferenceResponse(body=b"b") for _ in requests]

    (answer,) = run_batch(Again(), [InferenceRequest(request_id="r-1")], CONTEXT, parts=Recorder())
    assert answer.error == "Again.stream yielded a part for request r-1 after its final part"


def test_without_a_sink_parts_are_dropped_and_the_answers_still_come() -> None:
    handler = Counter()
    answers = run_batch(handler, requests(3), CONTEXT)  # warm-up runs a batch this way
    assert [n(a) for a in answers] == [2]
