"""What bounds scenario A: its model, or the request path around it?

    python -m benchmarks.model_cost [--rounds 5 --seconds 6]

Three servers up at once, loaded in turn each round (wrk, 32 connections, scenario A's
512-number row): the raw-ASGI ceiling (`baselines/raw_asgi.py`), scriptserve serving scenario
A's MLP (512 -> 1024 -> 1024 -> 10) on `/predictions/mlp`, and scriptserve with the scenarios'
settings serving a model that costs next to nothing (`models.Linear`, 512 -> 10, about 1/300 of
the MLP's multiply-adds) on `/predictions/linear`. The same request path carries both models;
only the model differs.

For each load it prints the req/s, the server's CPU per request on its event-loop thread and on
its other threads (the workers), and how many of the machine's cores were busy. Then, in-process
and on one thread, what each model's forward pass costs per row at batch 16. When the two
models serve alike, the model is not what bounds the throughput: the Python each request runs
on the loop and in the workers, one thread at a time under the GIL, is. Ratios are taken within
each round; the results go to benchmarks/results/model_cost-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import ab, models, report
from benchmarks.handler_threads import machine_busy_seconds
from benchmarks.loadgen import run_wrk, wrk_path
from benchmarks.scenarios import median
from benchmarks.servers import ServerProcess, uvicorn_app

_MODELS = ("mlp", "linear")
_BATCH = 16
_JSON_POST = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Load:
    rps: float
    p99_ms: float
    loop_us: float
    """CPU of the server's main thread (its event loop) per request."""
    other_us: float
    """CPU of every other thread of the server (its workers) per request."""
    cores: float | None
    """Cores busy on the whole machine during the load (wrk included); None without /proc."""


def _thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid` so far."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def measure(server: ServerProcess, path: str, body: Path, seconds: float) -> Load:
    assert server.proc is not None
    pid = server.proc.pid
    before, busy_before, began = _thread_seconds(pid), machine_busy_seconds(), time.perf_counter()
    result = run_wrk(server.url + path, 32, seconds, 2, body, _JSON_POST)
    after, busy_after, wall = _thread_seconds(pid), machine_busy_seconds(), time.perf_counter()
    if result.errors:
        raise SystemExit(f"{server.label}: {result.errors} errors in a measured run")
    wall -= began
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = used.pop(pid, 0.0)
    cores = None
    if busy_before is not None and busy_after is not None:
        cores = (busy_after - busy_before) / wall
    return Load(
        rps=result.rps,
        p99_ms=result.p99_ms,
        loop_us=loop / result.requests * 1e6,
        other_us=sum(used.values()) / result.requests * 1e6,
        cores=cores,
    )


def forward_us_per_row(model: models.BenchModel, batch: int = _BATCH, runs: int = 400) -> float:
    """Median CPU time per row of the scripted model's forward pass at `batch`, one thread."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(model.scripted)).eval()  # type: ignore[no-untyped-call]
    x = torch.randn(batch, *model.row_shape)
    times = []
    with torch.inference_mode():
        for _ in range(runs // 10):
            module(x)
        for _ in range(10):
            started = time.thread_time()
            for _ in range(runs // 10):
                module(x)
            times.append((time.thread_time() - started) / (runs // 10) / batch * 1e6)
    return statistics.median(times)


def _ratios(a: list[Load], b: list[Load]) -> list[float]:
    return [x.rps / y.rps for x, y in zip(a, b, strict=True)]


def _line(label: str, values: list[float]) -> str:
    rounds = " ".join(f"{v:.2f}" for v in values)
    return f"{label:<36}{median(values):>6.2f}  (rounds: {rounds})"


def summarise(runs: dict[str, list[Load]], forward: dict[str, float]) -> list[str]:
    lines = [
        f"{'load':<22}{'req/s':>8}{'p99 ms':>8}{'loop us/req':>13}{'workers us/req':>16}"
        f"{'cores busy':>12}"
    ]
    for key, loads in runs.items():
        cores = [x.cores for x in loads if x.cores is not None]
        lines.append(
            f"{key:<22}{median([x.rps for x in loads]):>8.0f}"
            f"{median([x.p99_ms for x in loads]):>8.2f}"
            f"{median([x.loop_us for x in loads]):>13.1f}"
            f"{median([x.other_us for x in loads]):>16.1f}"
            + (f"{median(cores):>12.2f}" if cores else f"{'-':>12}")
        )
    lines += [
        _line("linear / mlp", _ratios(runs["linear"], runs["mlp"])),
        _line("mlp / ceiling", _ratios(runs["mlp"], runs["ceiling"])),
        _line("linear / ceiling", _ratios(runs["linear"], runs["ceiling"])),
        f"forward pass per row at batch {_BATCH}, one thread: "
        + ", ".join(f"{name} {us:.1f} us" for name, us in forward.items()),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.model_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=2.0)
    opts = p.parse_args(argv)
    wrk_path()  # fail early, with the install hint, when wrk is missing
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="scriptserve-model-cost-") as tmp:
        work = Path(tmp)
        built = {name: models.build(name, work / name, work / name / "store") for name in _MODELS}
        body = built["mlp"].body  # the same row for both: the models share their input
        starts = {"ceiling": uvicorn_app("raw ASGI", "benchmarks.baselines.raw_asgi:app", {})}
        for name, model in built.items():
            store = model.archive.parent
            starts[name] = ab.server(f"scriptserve {name}", sys.executable, store, {}, name)
        paths = {"ceiling": "/", **{name: f"/predictions/{name}" for name in _MODELS}}
        runs: dict[str, list[Load]] = {key: [] for key in starts}
        with contextlib.ExitStack() as stack:
            servers = {key: stack.enter_context(server) for key, server in starts.items()}
            for key, server in servers.items():
                run_wrk(server.url + paths[key], 32, opts.warmup, 2, body, _JSON_POST)
            for round_ in range(1, opts.rounds + 1):
                for key, server in servers.items():
                    load = measure(server, paths[key], body, opts.seconds)
                    runs[key].append(load)
                    print(
                        f"round {round_}/{opts.rounds} {key:<8} {load.rps:8.0f} req/s  "
                        f"loop {load.loop_us:5.1f} us  workers {load.other_us:5.1f} us "
                        "per request",
                        flush=True,
                    )
        forward = {name: forward_us_per_row(model) for name, model in built.items()}
    lines = summarise(runs, forward)
    host = report.host(load_before)
    lines.append(report.host_line(host))
    print("\n".join(lines))
    document = {
        "host": host,
        "rounds": opts.rounds,
        "seconds": opts.seconds,
        "runs": {key: [vars(x) for x in loads] for key, loads in runs.items()},
        "forward_us_per_row": forward,
        "summary": lines,
    }
    report.write_results("model_cost", document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
