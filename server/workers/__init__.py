"""The workers that run a model version's batches: threads of the server, or child processes.

`build_pool` is what model loading uses; `WorkerPool` (`pool`) is the one pool, with a runner
that says what a worker is (`threads.ThreadRunner`, `process.runner.ProcessRunner`)::

    pool = build_pool(
        mode="thread", context=context, batcher=batcher, devices=["cpu"], metrics=metrics,
        response_timeout_s=120.0, policy=RestartPolicy(), max_abandoned=4, warmup_runs=2,
    )
    pool.scale(2)  # blocking: both workers have loaded their handler and warmed it up
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from scriptserve.handlers.base import BaseHandler, Context
from scriptserve.handlers.loader import load_handler
from scriptserve.server.observability.metrics import VersionMetrics
from scriptserve.server.workers.batching import DynamicBatcher
from scriptserve.server.workers.pool import RestartPolicy, WorkerPool, WorkerState
from scriptserve.server.workers.process.runner import ProcessRunner
from scriptserve.server.workers.process.slot import ProcessSlot
from scriptserve.server.workers.threads import ThreadRunner, ThreadSlot

__all__ = ["AnyWorkerPool", "RestartPolicy", "WorkerPool", "WorkerState", "build_pool"]

AnyWorkerPool = WorkerPool[ThreadSlot] | WorkerPool[ProcessSlot]


def build_pool(
    *,
    mode: Literal["thread", "process"],
    context: Context,
    batcher: DynamicBatcher,
    devices: list[str],
    metrics: VersionMetrics,
    response_timeout_s: float,
    policy: RestartPolicy,
    max_abandoned: int,
    warmup_runs: int = 0,
) -> AnyWorkerPool:
    """A pool with no workers yet (`scale` starts them) whose handlers are built from `context`,
    one per worker's device: in this process (`thread`) or in each worker process. Each worker
    runs the archive's sample input `warmup_runs` times before it joins."""
    name, version = context.model_name, context.model_version
    if mode == "process":
        runner = ProcessRunner(context, response_timeout_s, policy, warmup_runs)
        return WorkerPool(name, version, batcher, runner, devices, metrics)

    def build(device: str) -> tuple[BaseHandler, Context]:
        on_device = replace(context, device=device)
        return load_handler(on_device), on_device

    threads = ThreadRunner(build, response_timeout_s, max_abandoned, policy, warmup_runs)
    return WorkerPool(name, version, batcher, threads, devices, metrics)
