"""One request through a TorchServe workflow's DAG (`models/workflows.py`), as TorchServe's
DagExecutor runs it, each step through its own model's batcher and workers (no HTTP hop).

The start node takes the request as the client sent it. A node with one parent takes that
parent's answer as its body (`{"body": bytes}` in a TorchServe handler's `data`); a node with
several takes each parent's answer under the parent's name (`{"m1": bytes, "m2": bytes}`). A
node runs as soon as its last parent has answered, so independent branches run at once. The
answer is the one leaf's, or, with several leaves, a JSON object of each leaf's answer by name.
A step that fails is retried `retry-attempts` times when the failure is the server's (5xx), and
then fails the request alone, the step named in the error. The deadline (the client's
`X-Request-Timeout`, else the sum of the steps' timeouts along the longest path) covers the
whole run; each step waits at most its own `timeout-ms` within it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.codec import torchserve
from scriptserve.server.errors import DeadlineExceeded, ServingError, error_for_status
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models.workflows import Node, Workflow
from scriptserve.server.observability import access_log, tracing

log = logging.getLogger("scriptserve.workflows")


def pin_request(name: str) -> None:
    """Name the request running in this context `name` for good in its access line and span (a
    workflow's: its steps' models do not replace it)."""
    record, trace = access_log.current(), tracing.current()
    if record is not None:
        record.note_model(name, None, pin=True)
    if trace is not None:
        trace.note_model(name, None, pin=True)


async def run_workflow(
    plane: DataPlane,
    workflow: Workflow,
    request: InferenceRequest,
    timeout_s: float | None = None,
) -> tuple[bytes, str]:
    """The workflow's answer to `request`: its bytes and content type. Raises ServingError."""
    pin_request(workflow.name)  # the access line and the span name the workflow
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else _longest(workflow))
    answers: dict[str, tuple[bytes, str]] = {}
    waiting = {name: len(node.parents) for name, node in workflow.nodes.items()}
    running: dict[asyncio.Task[tuple[bytes, str]], str] = {}

    def start(name: str, given: InferenceRequest) -> None:
        task = asyncio.ensure_future(_step(plane, workflow, workflow.nodes[name], given, deadline))
        running[task] = name

    start(workflow.start, request)
    try:
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                name = running.pop(task)
                answers[name] = task.result()
                for child in workflow.nodes[name].children:
                    waiting[child] -= 1
                    if waiting[child] == 0:
                        start(child, _input_of(workflow.nodes[child], answers, request))
    finally:
        for task in running:
            task.cancel()
    leaves = workflow.leaves
    if len(leaves) == 1:
        return answers[leaves[0]]
    combined = {leaf: orjson.loads(answers[leaf][0]) for leaf in leaves}
    return orjson.dumps(combined), "application/json"


def _input_of(
    node: Node, answers: dict[str, tuple[bytes, str]], request: InferenceRequest
) -> InferenceRequest:
    if len(node.parents) == 1:
        fields = {"body": answers[node.parents[0]][0]}
    else:
        fields = {parent: answers[parent][0] for parent in node.parents}
    return torchserve.predictions_request(fields, headers=request.headers)


async def _step(
    plane: DataPlane, workflow: Workflow, node: Node, request: InferenceRequest, deadline: float
) -> tuple[bytes, str]:
    attempts = 1 + node.retries
    for attempt in range(1, attempts + 1):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(
                f"workflow {workflow.name!r}: the deadline passed before step {node.name!r}"
            )
        try:
            served = await plane.submit(
                node.model,
                None,
                request,
                protocol="workflow",
                timeout_s=min(remaining, node.timeout_s),
            )
            payload, content_type = torchserve.prediction_payload(served.response)
            return payload, content_type
        except ServingError as exc:
            if exc.status < 500 or attempt == attempts:
                raise error_for_status(
                    exc.status,
                    f"workflow {workflow.name!r} step {node.name!r} failed"
                    + (f" after {attempt} attempts" if attempt > 1 else "")
                    + f": {exc.message}",
                ) from None
            log.warning(
                "workflow=%s step %s failed (attempt %d of %d): %s",
                workflow.name,
                node.name,
                attempt,
                attempts,
                exc.message,
            )
    raise AssertionError("unreachable")  # the loop returns or raises


def _longest(workflow: Workflow) -> float:
    """The sum of the step timeouts along the workflow's longest path."""
    longest: dict[str, float] = {}
    for name, node in workflow.nodes.items():  # parents come first
        before = max((longest[p] for p in node.parents), default=0.0)
        longest[name] = before + node.timeout_s * (1 + node.retries)
    return max(longest.values())
