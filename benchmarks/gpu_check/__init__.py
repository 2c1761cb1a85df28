"""`make gpu-check`: every CUDA path of scriptserve shown on one GPU by one command (made to
fit 8 minutes on one H100), and the same steps on the CPU with `--dry-run`.

    python -m benchmarks.gpu_check --prepare build/gpu-wheels   # here: what travels (cp312)
    python -m benchmarks.gpu_check --wheels build/gpu-wheels    # on the GPU machine
    python -m benchmarks.gpu_check --dry-run                    # here, on the CPU

The GPU machines this is made for have Python 3.12, PyTorch with CUDA and the CPU build of
onnxruntime installed, and reach no package index: `--prepare` downloads the cp312 wheels of
what serving and the tests need that such a machine lacks, at most 64 MiB in all (so not
onnxruntime-gpu: its CUDA check waits for a machine that has it); scriptserve itself is built
there from the tree that travels with them, so what runs is always that tree.

Steps, each timed and recorded; a failed step is recorded and the next ones still run:

1. `install`: the wheels into this Python (`--no-index`), and scriptserve built from this tree
   with the machine's setuptools, afresh every run.
2. `environment`: Python, torch and CUDA, the GPU, onnxruntime's providers.
3. `archives`: an MLP as TorchScript and as a `.pt2` compiled on this machine for the device
   (Inductor's cache under build/gpu-check, so a second run on a warm machine compiles less),
   and on a GPU a `.pt2` for the CPU as well, for `loads`.
4. `loads`: each `.pt2` loaded and run in fresh processes, each set up differently first
   (benchmarks/gpu_loads.py), with the native frames of any crash.
5. `benchmark`: in-process (the backend the server uses) at batch 1, 8 and 64 for each format,
   TorchScript and `.pt2` with and without CUDA graphs.
6. `served`: `scriptserve serve` on the device with batching, one server per model (a model
   that brings its server down does not hide the other's result); 64 concurrent requests over
   REST (OIP JSON) and 64 over gRPC (`ModelInfer`), every answer checked against the model run
   on the CPU, the batches they shared read from /metrics; and the `.pt2` served at batch 64
   over gRPC (4 clients), as items/s and as a share of the in-process figure.
7. `tests`: every `gpu`-marked test (`pytest -m gpu`; dry, only collected), last because it is
   the longest.

Writes benchmarks/results/gpu-<date>.json (with `--dry-run`, build/gpu-check/gpu-dry-run.json)
and exits 1 when a step failed. SIGTERM (a time limit's `timeout`) stops the check: the step
that ran is recorded as stopped, its commands and servers are ended, and it exits 143. Only
the standard library is imported before `install`.

The package, by concept: `plan` (what runs, on what, within which bounds), `travel` (the wheels
that go to the machine, and installing them), `check` (the steps), `mlp` (the model the steps
measure, and the clients that measure it), `stopping` (SIGTERM) and `cli`.
"""

from __future__ import annotations

from benchmarks.gpu_check.check import Check, StepFailed
from benchmarks.gpu_check.plan import BATCHES, GPU_TESTS, TOLERANCE
from benchmarks.gpu_check.stopping import stoppable
from benchmarks.gpu_check.travel import LIMIT_BYTES

__all__ = ["BATCHES", "GPU_TESTS", "LIMIT_BYTES", "TOLERANCE", "Check", "StepFailed", "stoppable"]
