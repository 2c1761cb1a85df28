"""Warm-up: a new worker runs the archive's sample input before it takes any request.

The first calls of a freshly loaded model pay for lazy initialisation: TorchScript's profiling
executor records the first call and optimises the graph on the second (each many times a steady
call: benchmarks/README.md), AOTInductor and ONNX Runtime set up their kernels and memory on
first use. A worker therefore runs the sample input `runs` times before its slot joins the
pool, so the model reports ready only once every worker is warm, and the first client request
costs what later ones do.

The sample is the archive's `sampleInput` file, given the way both kinds of client send it: as
the JSON body `/predictions` (and `scriptserve predict`) would receive, and, when the archive
records the model's inputs, as those input tensors too, what an Open Inference Protocol request
carries. A run that fails stops the warm-up: the worker serves all the same (the sample may not
suit a handler written for other inputs), and the failure is logged and shown by describe::

    result = warm_up(handler, context, runs=2, worker=1)
    result.runs, result.seconds, result.error  # (2, 0.047, None)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import numpy as np

from scriptserve.handlers.base import BaseHandler, Context, InferenceRequest, run_batch
from scriptserve.handlers.runtime.signature import SignatureError, arrays_from_json

log = logging.getLogger("scriptserve.workers")


@dataclass(frozen=True)
class WarmupResult:
    """What one worker's warm-up did (pickled from a worker process to the server)."""

    runs: int = 0
    """Runs of the sample input that completed."""
    seconds: float = 0.0
    """Time the warm-up took, all runs together."""
    first_s: float | None = None
    """The first run's time: how much a cold worker would have made its first request wait."""
    error: str | None = None
    """Why a run failed; None when none did."""
    skipped: str | None = None
    """Why nothing ran (the archive has no sample input); None when the warm-up ran."""

    def describe(self) -> dict[str, object]:
        """The worker's warm-up as describe lists it."""
        found: dict[str, object] = {
            "warmupRuns": self.runs,
            "warmupMs": round(self.seconds * 1000.0, 3),
        }
        if self.first_s is not None:
            found["warmupFirstRunMs"] = round(self.first_s * 1000.0, 3)
        if self.error is not None:
            found["warmupError"] = self.error
        if self.skipped is not None:
            found["warmupSkipped"] = self.skipped
        return found


def sample_body(context: Context) -> bytes | None:
    """The archive's sample input (the manifest's `sampleInput`), or None when it has none."""
    info = context.manifest.scriptserve
    if info is None or not info.sample_input:
        return None
    return (context.model_dir / info.sample_input).read_bytes()


def sample_tensors(body: bytes, context: Context) -> dict[str, np.ndarray]:
    """The sample as the model's input tensors (a batch of one), when the archive records the
    model's inputs and the sample fits them; else none."""
    signature = context.manifest.signature
    if not signature.inputs:
        return {}
    try:
        return arrays_from_json(json.loads(body), signature)
    except (ValueError, SignatureError):
        return {}


def warm_up(handler: BaseHandler, context: Context, runs: int, worker: int) -> WarmupResult | None:
    """Run the sample input through `handler` `runs` times, one request per run; None when
    warm-up is off (`runs` 0). Blocking; never raises: a failure ends the warm-up early and is
    reported in the result (and the log)."""
    if runs <= 0:
        return None
    name, version = context.model_name, context.model_version
    try:
        body = sample_body(context)
    except OSError as exc:
        reason = f"the archive's sample input cannot be read ({exc.strerror})"
        return _skipped(context, worker, reason)
    if body is None:
        return _skipped(context, worker, "the archive has no sample input")
    tensors = sample_tensors(body, context)
    started = time.perf_counter()
    first_s: float | None = None
    for run in range(runs):
        request = InferenceRequest(
            inputs=dict(tensors),
            body=body,
            content_type="application/json",
            request_id=f"warmup-{worker}-{run + 1}",
        )
        (response,) = run_batch(handler, [request], context)
        if first_s is None:
            first_s = time.perf_counter() - started
        if response.error is not None:
            log.warning(
                "model=%s version=%s worker %d: warm-up run %d of %d failed (%s); the worker "
                "serves without warm-up",
                name,
                version,
                worker,
                run + 1,
                runs,
                response.error,
            )
            error = f"run {run + 1} failed: {response.error}"
            return WarmupResult(run, time.perf_counter() - started, first_s, error)
    result = WarmupResult(runs, time.perf_counter() - started, first_s)
    log.info(
        "model=%s version=%s worker %d warmed up: %d run(s) of the sample input in %.1f ms "
        "(first %.1f ms)",
        name,
        version,
        worker,
        runs,
        result.seconds * 1000.0,
        (first_s or 0.0) * 1000.0,
    )
    return result


def _skipped(context: Context, worker: int, reason: str) -> WarmupResult:
    log.info(
        "model=%s version=%s worker %d not warmed up: %s",
        context.model_name,
        context.model_version,
        worker,
        reason,
    )
    return WarmupResult(skipped=reason)
