"""One batch handed to a worker process and its answers read back: the requests through the
slot's shared-memory segment, a small description over the pipe, streamed parts relayed as they
come, the responses out of the responses segment (grown on the worker's request)."""

from __future__ import annotations

from time import monotonic, perf_counter

from scriptserve.handlers.base import (
    InferenceRequest,
    InferenceResponse,
    StageTimes,
    StreamClosed,
)
from scriptserve.handlers.metrics import HandlerMetrics
from scriptserve.handlers.parts import PartSink
from scriptserve.server.workers.process import shared_memory as frames
from scriptserve.server.workers.process.child_process import Child
from scriptserve.server.workers.process.slot import ProcessSlot


def exchange(
    slot: ProcessSlot,
    child: Child,
    requests: list[InferenceRequest],
    times: StageTimes,
    parts: PartSink,
    *,
    timeout_s: float,
    metrics: HandlerMetrics,
) -> list[InferenceResponse]:
    """Send a batch to the worker process and read its responses back; the hand-over both
    ways counts into the batch's input and output stages, with the worker's own. Parts a
    streaming handler sends come first, each step answered with whether anyone listens."""
    started = perf_counter()
    frame = frames.Frame()
    described = [frames.describe_request(frame, request) for request in requests]
    slot.requests = frames.ensure_segment(slot.requests, frame.size)
    frame.write(frames.segment_view(slot.requests))
    times.input_s += perf_counter() - started
    deadline = monotonic() + timeout_s
    child.send(("run", slot.requests.name, slot.responses.name, slot.responses.size, described))
    while True:
        reply = child.receive(deadline)
        if reply[0] == "grow":  # the responses need a bigger segment
            slot.responses = frames.ensure_segment(slot.responses, reply[1])
            child.send(("output", slot.responses.name, slot.responses.size))
            continue
        if reply[0] == "parts":
            try:
                parts.send(reply[1])
            except StreamClosed:
                child.send(("listening", False))
            else:
                child.send(("listening", True))
            continue
        _, metas, (input_s, output_s), changes = reply
        if changes:
            metrics.merge(changes)
        reading = perf_counter()
        buf = frames.segment_view(slot.responses)
        responses = [frames.read_response(buf, meta) for meta in metas]
        times.input_s += input_s
        times.output_s += output_s + perf_counter() - reading
        return responses
