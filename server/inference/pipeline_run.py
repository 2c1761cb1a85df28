"""One request through a pipeline (`models/pipelines.py`): each step through its own model's
batcher and workers, its input tensors taken from the request or from the steps before it, in
memory (no HTTP hop, no re-encoding); a step runs as soon as its inputs exist, so independent
steps run at once. The deadline covers the whole pipeline; a failing step fails the request
alone, the step named in the error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol

import numpy as np

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.server.errors import DeadlineExceeded, InvalidInput, ServingError, error_for_status
from scriptserve.server.inference.decoding import Encode, Served
from scriptserve.server.models.pipelines import VERSION, Pipeline, Step

STEP_PROTOCOL = "pipeline"
"""The `protocol` label of a step's requests in the metrics: a pipeline's, not a client's."""
DEFAULT_TIMEOUT_S = 120.0
"""A pipeline's deadline when the client gives none."""


class Infer(Protocol):
    """`DataPlane.submit`: one request to one model version, whose answer is awaited."""

    def __call__(
        self,
        name: str,
        version: str | None,
        request: InferenceRequest,
        *,
        protocol: str,
        timeout_s: float | None = None,
    ) -> Awaitable[Served]: ...


async def run_pipeline(
    infer: Infer,
    pipeline: Pipeline,
    request: InferenceRequest,
    timeout_s: float | None,
    protocol: str,
    encode: Encode | None = None,
) -> Served:
    """The pipeline's answer: its outputs (those `request.outputs` names, else all), written by
    `encode` when the transport gave one (`DataPlane.submit`)."""
    missing = [name for name in pipeline.inputs if name not in request.inputs]
    if missing:
        raise InvalidInput(
            f"pipeline {pipeline.name!r} needs input {missing[0]!r} (inputs: "
            f"{', '.join(pipeline.inputs)}); see GET /v2/models/{pipeline.name}"
        )
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    tensors: dict[str, np.ndarray] = {name: request.inputs[name] for name in pipeline.inputs}
    left = list(pipeline.steps)
    running: dict[asyncio.Task[InferenceResponse], Step] = {}

    def start_ready() -> None:
        for step in [s for s in left if set(s.inputs.values()) <= tensors.keys()]:
            left.remove(step)
            task = asyncio.ensure_future(_step(infer, pipeline, step, tensors, deadline))
            running[task] = step

    start_ready()
    try:
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                step = running.pop(task)
                made = dict(task.result().outputs)
                for own, tensor in step.outputs.items():
                    if own not in made:
                        raise ServingError(
                            f"pipeline {pipeline.name!r} step {step.model!r} answered without "
                            f"its output {own!r} (it answered {', '.join(made) or 'none'})"
                        )
                    tensors[tensor] = made[own]
            start_ready()
    finally:
        for task in running:
            task.cancel()
    wanted = request.outputs or list(pipeline.outputs)
    unknown = [name for name in wanted if name not in pipeline.outputs]
    if unknown:
        raise InvalidInput(
            f"pipeline {pipeline.name!r} has no output {unknown[0]!r} (outputs: "
            f"{', '.join(pipeline.outputs)})"
        )
    outputs = [(name, tensors[name]) for name in wanted]
    if encode is not None:
        encode(pipeline.name, VERSION, outputs)
    return Served(pipeline.name, VERSION, InferenceResponse(outputs=dict(outputs)), outputs)


async def _step(
    infer: Infer,
    pipeline: Pipeline,
    step: Step,
    tensors: dict[str, np.ndarray],
    deadline: float,
) -> InferenceResponse:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded(
            f"pipeline {pipeline.name!r}: the deadline passed before step {step.model!r}"
        )
    given = InferenceRequest(
        inputs={own: tensors[tensor] for own, tensor in step.inputs.items()},
        outputs=list(step.outputs),
    )
    try:
        served = await infer(
            step.model, step.version, given, protocol=STEP_PROTOCOL, timeout_s=remaining
        )
    except ServingError as exc:
        raise error_for_status(
            exc.status, f"pipeline {pipeline.name!r} step {step.model!r}: {exc.message}"
        ) from None
    return InferenceResponse(outputs=dict(served.outputs))
