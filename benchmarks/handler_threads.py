"""Throughput of 1 vs 2 worker threads through the `tensor` handler: eager vs TorchScript vs ONNX
vs a `.pt2` package (torch.export + AOTInductor, called through its C ABI).

Each worker thread calls `TensorHandler.handle` on a batch of one request of `--rows` rows, on
one shared handler (as the worker pool shares a thread-safe handler), with one intra-op thread
per worker. TorchScript, ONNX Runtime and the `.pt2` backend release the GIL while the model
runs, so two threads should come close to twice the throughput of one; eager PyTorch holds the
GIL between ops. The `.pt2` archive is compiled first (10 to 25 s).

    python benchmarks/handler_threads.py            # 3 s per measurement, median of 3
    python benchmarks/handler_threads.py --quick    # a smoke run in a few seconds
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.handlers.base import BaseHandler, Context, InferenceRequest
from scriptserve.handlers.loader import load_handler, read_model_config

IN_FEATURES = 256


class BenchMLP(nn.Module):
    """256 -> 512 -> 512 -> 10, fixed weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(IN_FEATURES, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class EagerBackend:
    """The handlers/backends protocol around an eager nn.Module, for comparison only."""

    device = "cpu"
    input_names = ("x",)
    output_names = ("output0",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module.eval()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = self.module(torch.from_numpy(np.ascontiguousarray(inputs["x"])))
        return {"output0": out.numpy()}


def export_models(workdir: Path) -> dict[str, Path]:
    """TorchScript and ONNX files of BenchMLP, and a .pt2 package compiled from its state
    dict, packed as archives with the `tensor` handler."""
    module = BenchMLP().eval()
    sample = workdir / "sample.json"
    sample.write_text("[" + ", ".join(["0.1"] * IN_FEATURES) + "]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(module).save(str(workdir / "mlp.pt"))  # type: ignore[no-untyped-call]
        torch.onnx.export(
            module,
            (torch.zeros(1, IN_FEATURES),),
            str(workdir / "mlp.onnx"),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
    archives = {}
    for name, model in (("mlp_torchscript", "mlp.pt"), ("mlp_onnx", "mlp.onnx")):
        argv = [
            "--model-name", name, "--version", "1.0",
            "--serialized-file", str(workdir / model), "--sample-input", str(sample),
            "--export-path", str(workdir / "store"), "-f",
        ]  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the archive's path
            assert model_archiver_main(argv) == 0
        archives[name] = workdir / "store" / f"{name}.mar"
    torch.save(module.state_dict(), workdir / "mlp_state.pt")
    argv = [
        "--model-name", "mlp_pt2", "--version", "1.0", "--export-pt2",
        "--model-file", __file__, "--model-class", "BenchMLP",
        "--serialized-file", str(workdir / "mlp_state.pt"), "--sample-input", str(sample),
        "--export-path", str(workdir / "store"), "-f",
    ]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert model_archiver_main(argv) == 0
    archives["mlp_pt2"] = workdir / "store" / "mlp_pt2.mar"
    return archives


@contextlib.contextmanager
def loaded(archive: Path) -> Iterator[tuple[BaseHandler, Context]]:
    with open_archive(archive) as reader:
        manifest = reader.manifest
        context = Context(
            model_name=manifest.model.model_name,
            model_version=manifest.model.model_version,
            model_dir=reader.root,
            manifest=manifest,
            model_config=read_model_config(reader.root, manifest),
            device="cpu",
            intra_op_threads=1,
            workers=2,  # as many as the measurements' threads, like a pool of two workers
        )
        yield load_handler(context), context


@dataclass(frozen=True)
class Run:
    """One measurement: requests per second; cores this process kept busy (CPU seconds per
    second: below the thread count means waiting, on the GIL or for a core); cores other
    processes kept busy meanwhile (None where /proc/stat is missing)."""

    rate: float
    cores: float
    others: float | None


def machine_busy_seconds() -> float | None:
    """CPU seconds every process on the machine has spent busy so far (Linux), else None."""
    try:
        first_line = Path("/proc/stat").read_text().split("\n", 1)[0]
    except OSError:
        return None
    ticks = [int(f) for f in first_line.split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle + iowait; steal counts as busy: someone else's work
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def measure(
    handler: BaseHandler, context: Context, request: InferenceRequest, threads: int, seconds: float
) -> Run:
    """`threads` threads calling handle() on one shared handler for `seconds`."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def worker(slot: int) -> None:
        torch.set_num_threads(1)  # one intra-op thread per worker: workers x 1 <= cores
        start.wait()
        done = 0
        while time.perf_counter() < deadline[0]:
            handler.handle([request], context)
            done += 1
        counts[slot] = done

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    machine_began = machine_busy_seconds()
    began, cpu_began = time.perf_counter(), time.process_time()
    deadline[0] = began + seconds
    start.wait()
    for t in pool:
        t.join()
    wall = time.perf_counter() - began
    cores = (time.process_time() - cpu_began) / wall
    machine_ended = machine_busy_seconds()
    others = None
    if machine_began is not None and machine_ended is not None:
        others = max(0.0, (machine_ended - machine_began) / wall - cores)
    return Run(sum(counts) / wall, cores, others)


def benchmark(
    handler: BaseHandler, context: Context, rows: int, seconds: float, repeats: int
) -> dict[int, Run]:
    """Per thread count, the run with the median rate, after a warm-up.

    1- and 2-thread runs alternate, so a change in other load on the machine hits both alike.
    """
    x = np.random.default_rng(0).standard_normal((rows, IN_FEATURES)).astype(np.float32)
    request = InferenceRequest(inputs={"x": x})
    (response,) = handler.handle([request], context)
    if response.error is not None:
        raise SystemExit(f"{context.model_name}: {response.error}")
    measure(handler, context, request, threads=2, seconds=min(1.0, seconds))  # warm up
    runs: dict[int, list[Run]] = {1: [], 2: []}
    for _ in range(repeats):
        for threads, done in runs.items():
            done.append(measure(handler, context, request, threads, seconds))
    return {
        threads: sorted(done, key=lambda r: r.rate)[len(done) // 2]
        for threads, done in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per config (median)")
    parser.add_argument("--rows", type=int, default=8, help="rows in the one request of a batch")
    parser.add_argument("--quick", action="store_true", help="0.5 s measurements, one repeat")
    args = parser.parse_args()
    seconds, repeats = (0.5, 1) if args.quick else (args.seconds, args.repeats)

    torch.set_num_interop_threads(1)
    torch.set_num_threads(1)
    print(
        f"cores={os.cpu_count()} torch={torch.__version__} rows/request={args.rows} "
        f"{seconds:g} s x {repeats} (median), intra-op threads=1 per worker"
    )
    results: dict[str, dict[int, Run]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-handler-threads-") as tmp:
        archives = export_models(Path(tmp))
        for name, archive in (
            ("eager", archives["mlp_torchscript"]),
            ("torchscript", archives["mlp_torchscript"]),
            ("onnx", archives["mlp_onnx"]),
            ("pt2", archives["mlp_pt2"]),
        ):
            with loaded(archive) as (handler, context):
                if name == "eager":
                    # Same archive, handler and signature; only the model call is eager.
                    handler.model = EagerBackend(BenchMLP())
                results[name] = benchmark(handler, context, args.rows, seconds, repeats)

    header = ("backend", "threads", "req/s", "rows/s", "cores", "others", "2 vs 1")
    print("{:<12} {:>7} {:>9} {:>10} {:>6} {:>6} {:>7}".format(*header))
    for name, by_threads in results.items():
        for threads, run in by_threads.items():
            speedup = f"{run.rate / by_threads[1].rate:.2f}x" if threads == 2 else ""
            others = "-" if run.others is None else f"{run.others:.2f}"
            print(
                f"{name:<12} {threads:>7} {run.rate:>9.0f} {run.rate * args.rows:>10.0f} "
                f"{run.cores:>6.2f} {others:>6} {speedup:>7}"
            )
    print(
        "cores: CPU seconds per second this process used; others: the same for every other "
        "process (above ~0.1 the figures are disturbed)"
    )


if __name__ == "__main__":
    main()
