"""The process that worker processes are forked from: multiprocessing's fork server, with what
every worker imports imported once.

A fresh interpreter per worker would import torch again for each (seconds of CPU, paid on every
start, crash and scale-up). The fork server imports torch, the worker's code and the built-in
handler's torch backends, runs nothing (no torch thread pool, no GPU context: those are made in
each worker), and forks a worker per start. ONNX Runtime starts a thread when imported, so it
is not preloaded. The fork server starts with the first worker, or at the server's start with
`start` when process workers are the server's default.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

PRELOAD = [
    "__main__",
    "torch",
    "scriptserve.server.workers.process.child",
    "scriptserve.handlers.tensor",
    "scriptserve.handlers.backends.torchscript",
    "scriptserve.handlers.backends.pt2",
]


def context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's fork server context, with what the fork server imports when it starts
    (set here, not at import: the fork server is one per process, and a process that starts
    one for other children of its own, as the tests do, sets its own list)."""
    forks = multiprocessing.get_context("forkserver")
    forks.set_forkserver_preload(PRELOAD)
    return forks


def start() -> None:
    """Start the fork server now, not with the first worker: its imports then run beside the
    server's own start instead of ahead of the first worker's load. Returns at once."""
    context()
    multiprocessing.forkserver.ensure_running()
