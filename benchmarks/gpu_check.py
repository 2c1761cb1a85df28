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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "build" / "gpu-check"
RESULTS = REPO / "benchmarks" / "results"
LIMIT_BYTES = 64 * 2**20
"""What may travel to the GPU machine with the working tree."""
TRAVEL = [
    # serving (scriptserve's own dependencies but torch, torchao, onnx, tokenizers)
    "numpy>=1.26", "pyyaml>=6.0", "orjson>=3.9", "pysimdjson>=6.0", "fastapi>=0.115",
    "uvicorn>=0.30", "httptools>=0.6", "uvloop>=0.19", "pydantic>=2.7", "pydantic-settings>=2.4",
    "prometheus-client>=0.20", "python-multipart>=0.0.9", "grpcio>=1.85.1", "protobuf>=7.35.1",
    "grpcio-health-checking>=1.85.1", "grpcio-reflection>=1.85.1",
    "googleapis-common-protos>=1.63", "pillow>=10.0", "filelock>=3.12", "httpx>=0.27",
    # the check itself and the gpu-marked tests; setuptools builds scriptserve there
    "pytest>=8", "pytest-timeout>=2.3", "psutil>=5.9", "setuptools>=77",
]  # fmt: skip
"""Requirements whose cp312 wheels travel (with their own dependencies). torch and onnxruntime
are the machine's; torchao (int8), onnx (ONNX export) and tokenizers (text handlers) are left
out for room: the steps that need them say so."""
GPU_TESTS: dict[str, tuple[str, ...]] = {
    "tests/handlers/test_backends.py": (),
    "tests/handlers/test_pt2_backend.py": (),
    "tests/archiver/test_precision.py": (),
    "tests/server/test_gauges.py": (),
    "tests/training/test_fsdp.py": ("sklearn", "matplotlib"),
}
"""The files holding `gpu`-marked tests (tests/packaging/test_gpu_check.py keeps this true), with
the modules each needs beyond what travels: a file whose modules are missing is listed as not
run, with them named (the training tests need the `train` extra: SciPy and scikit-learn alone
are larger than what may travel)."""
BATCHES = (1, 8, 64)
FEATURES, HIDDEN, CLASSES = 512, 2048, 16
TOLERANCE = 2e-3
"""Largest difference allowed between an answer and the CPU's (TF32 and kernel choice on GPUs)."""


class StepFailed(RuntimeError):
    """A step that failed with findings worth keeping in its record."""

    def __init__(self, message: str, found: dict[str, Any]) -> None:
        super().__init__(message)
        self.found = found


class Stopped(BaseException):
    """SIGTERM arrived (a time limit's `timeout`, the machine going away): the step that runs
    is recorded as stopped and no further step runs. A BaseException, so that no step's own
    handling takes it for a failure of the step's; on its way out it ends what the step started
    (`subprocess.run` kills its command, a server's `with` block stops the server)."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


class Check:
    """The steps' results, in the order they ran."""

    def __init__(self, dry_run: bool, wheels: Path | None, seconds: float) -> None:
        self.dry_run = dry_run
        self.wheels = wheels
        self.seconds = seconds
        self.device = "cpu" if dry_run else "cuda:0"
        self.steps: dict[str, dict[str, Any]] = {}
        self.archives: dict[str, Path] = {}
        self.in_process: dict[str, Any] = {}
        """The `benchmark` step's figures, which `served` compares its own with."""
        self.store = WORK / "store"
        self.probe_dir = WORK / "probe"
        self.when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M%S")
        self.out: Path | None = None
        self.logs = WORK

    def step(self, name: str, work: Callable[[], dict[str, Any]]) -> None:
        """Run one step and record it; the results file is rewritten after each, so a check cut
        short by a time limit still says how far it got."""
        started = time.perf_counter()
        try:
            record: dict[str, Any] = {"ok": True, **work()}
        except StepFailed as exc:
            record = {"ok": False, "error": str(exc), **exc.found}
        except (Exception, SystemExit) as exc:  # a command-line tool's exit fails the step only
            record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        except Stopped as exc:
            self._record(name, {"ok": False, "error": str(exc)}, started)
            raise
        self._record(name, record, started)

    def _record(self, name: str, record: dict[str, Any], started: float) -> None:
        record["seconds"] = round(time.perf_counter() - started, 1)
        self.steps[name] = record
        state = "ok" if record["ok"] else f"FAILED: {record['error']}"
        print(f"[gpu-check] {name}: {state} ({record['seconds']} s)", flush=True)
        if self.out is not None:
            self.write(self.out)

    def write(self, out: Path) -> bool:
        """The results file; True when every step so far was ok."""
        result = {
            "when": self.when,
            "dry_run": self.dry_run,
            "device": self.device,
            "steps": self.steps,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        return all(s["ok"] for s in self.steps.values())

    # -- environment ------------------------------------------------------------------------------
    def environment(self) -> dict[str, Any]:
        import torch

        found: dict[str, Any] = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        }
        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
            found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            found["gpus"] = torch.cuda.device_count()
        elif not self.dry_run:
            raise RuntimeError("torch sees no CUDA device: run with --dry-run on a CPU machine")
        if importlib.util.find_spec("onnxruntime") is not None:
            import onnxruntime

            found["onnxruntime"] = onnxruntime.__version__
            found["onnxruntime_providers"] = onnxruntime.get_available_providers()
        return found

    # -- install ----------------------------------------------------------------------------------
    def install(self) -> dict[str, Any]:
        if self.wheels is None:
            if importlib.util.find_spec("scriptserve") is None:
                raise RuntimeError("scriptserve is not installed: give --wheels DIR")
            return {"installed": "nothing (no --wheels): scriptserve as found"}
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(self.wheels),
        ]
        # With the minimums: a machine's older protobuf or grpcio (gencode must not be newer than
        # the runtime) is upgraded from the wheels; what is new enough is kept.
        _pip(pip, TRAVEL)
        # scriptserve itself from the tree that travelled, built here with this Python's
        # setuptools (nothing fetched), every run: a wheel prepared earlier could be older.
        built = WORK / "wheel"
        done = subprocess.run(
            [str(REPO / "docker" / "wheelhouse.sh"), "--project-only", str(built)],
            env={
                **os.environ,
                "PYTHON": sys.executable,
                "PIP_NO_INDEX": "1",
                "PIP_NO_BUILD_ISOLATION": "false",
            },  # pip reads "no-" options inverted
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"building scriptserve's wheel failed:\n{done.stderr[-2000:]}")
        (wheel,) = built.glob("scriptserve-*.whl")
        _pip(pip, ["--no-deps", "--force-reinstall", str(wheel)])
        return {"installed": [wheel.name, *TRAVEL]}

    # -- tests ------------------------------------------------------------------------------------
    def tests(self) -> dict[str, Any]:
        runnable, not_run = [], {}
        for path, modules in GPU_TESTS.items():
            missing = [m for m in modules if importlib.util.find_spec(m) is None]
            if missing:
                not_run[path] = f"needs {', '.join(missing)}, not installed here"
            else:
                runnable.append(path)
        # Dry, they are collected (on the CPU each would be skipped): what the GPU would run.
        mode = ["--collect-only"] if self.dry_run else ["-rfEs", "--durations=15"]
        report = ["--tb=short", "--show-capture=no"]  # the tests' own logs would bury the reasons
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
        done = subprocess.run(
            [*command, *mode, *report, *runnable],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=420,
            check=False,
        )
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.logs / "gpu-tests.log").write_text(done.stdout + done.stderr)
        tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
        found = r"(\d+)(?:/\d+)? (passed|failed|skipped|error|tests collected)"
        counts = {k.split()[-1]: int(n) for n, k in re.findall(found, tail)}
        if done.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
            failed = [
                line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))
            ]
            raise RuntimeError(f"pytest -m gpu: {tail}\n" + "\n".join(failed))
        if not self.dry_run and not counts.get("passed"):
            raise RuntimeError(f"pytest -m gpu ran nothing on the GPU: {tail}")
        return {"summary": tail, **counts, "not_run": not_run}

    # -- archives ---------------------------------------------------------------------------------
    def make_archives(self) -> dict[str, Any]:
        import torch

        from scriptserve.archiver.cli import model_archiver_main

        src = WORK / "src"
        src.mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        (src / "mlp.py").write_text(MODEL_FILE)
        module = _load_model(src / "mlp.py")
        torch.save(module.state_dict(), src / "mlp-weights.pt")
        torch.jit.script(module).save(str(src / "mlp.pt"))  # type: ignore[no-untyped-call]
        (src / "sample.json").write_text(json.dumps([0.01 * i for i in range(FEATURES)]))
        common = [
            "--version",
            "1.0",
            "--handler",
            "tensor",
            "--export-path",
            str(self.store),
            "--sample-input",
            str(src / "sample.json"),
            "-f",
        ]
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(WORK / "inductor"))
        self.archives = {
            "torchscript": self.store / "mlp_ts.mar",
            "pt2": self.store / "mlp_pt2.mar",
        }
        stamp = self.store / "made-with.json"
        made_with = json.dumps([torch.__version__, self.device, MODEL_FILE])
        made_before = all(p.exists() for p in [*self.archives.values(), stamp])
        if made_before and stamp.read_text() == made_with:  # a second run on a warm machine
            return {"reused": sorted(p.name for p in self.archives.values())}
        made: dict[str, Any] = {}
        started = time.perf_counter()
        argv = ["--model-name", "mlp_ts", "--serialized-file", str(src / "mlp.pt"), *common]
        if model_archiver_main(argv) != 0:
            raise RuntimeError("model-archiver failed for the TorchScript archive")
        made["torchscript_s"] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()
        device = "cuda" if self.device.startswith("cuda") else "cpu"
        argv = [
            "--model-name",
            "mlp_pt2",
            "--export-pt2",
            "--model-file",
            str(src / "mlp.py"),
            "--model-class",
            "MLP",
            "--serialized-file",
            str(src / "mlp-weights.pt"),
            "--pt2-device",
            device,
            "--max-batch",
            "64",
            *common,
        ]
        if model_archiver_main(argv) != 0:
            raise RuntimeError(f"model-archiver failed to compile the .pt2 for {device}")
        made["pt2_compile_s"] = round(time.perf_counter() - started, 1)
        if device == "cuda":  # a CPU package too, for `loads`; outside the served store
            started = time.perf_counter()
            cpu_argv = [*argv[: argv.index("--pt2-device")], "--pt2-device", "cpu", *common]
            cpu_argv[cpu_argv.index("mlp_pt2")] = "mlp_pt2_cpu"
            cpu_argv[cpu_argv.index("--export-path") + 1] = str(self.probe_dir)
            self.probe_dir.mkdir(parents=True, exist_ok=True)
            if model_archiver_main(cpu_argv) != 0:
                raise RuntimeError("model-archiver failed to compile the .pt2 for cpu")
            made["pt2_cpu_compile_s"] = round(time.perf_counter() - started, 1)
        stamp.write_text(made_with)
        return made

    # -- loads ------------------------------------------------------------------------------------
    def loads(self) -> dict[str, Any]:
        """The `.pt2` packages loaded and run in fresh processes, each set up differently first
        (benchmarks/gpu_loads.py): a crash names the set-up a container needs."""
        from benchmarks import gpu_loads

        archives = [(self.archives["pt2"], FEATURES)]
        cpu = self.probe_dir / "mlp_pt2_cpu.mar"
        if self.device.startswith("cuda") and cpu.exists():
            archives.append((cpu, FEATURES))
        # On the CPU (the dry run) the plain load and the crash handler show the step works.
        setups = gpu_loads.SETUPS if self.device.startswith("cuda") else ("plain",)
        found = gpu_loads.probe(archives, setups)
        failed = gpu_loads.crashed(found)
        if failed:
            raise StepFailed(f"{len(failed)} fresh processes failed: {', '.join(failed)}", found)
        return found

    # -- benchmark --------------------------------------------------------------------------------
    def benchmark(self) -> dict[str, Any]:
        """In-process figures of each format and variant; one that fails is recorded with its
        error and the others still measured."""
        import numpy as np

        from scriptserve.archiver.archive import open_archive
        from scriptserve.handlers.backends import load_backend

        figures: dict[str, Any] = {}
        failed: list[str] = []
        rng = np.random.default_rng(1)
        variants = [("", {})]
        if self.device.startswith("cuda"):
            variants.append(("_graphs", {"cuda_graphs": True}))
        else:
            figures["cuda_graphs"] = "not measured: CUDA graphs apply to models on GPUs"
        for fmt, archive in self.archives.items():
            with open_archive(archive) as reader:
                manifest = reader.manifest
                path = reader.root / manifest.model.serialized_file
                for suffix, options in variants:
                    try:
                        backend = load_backend(
                            path, manifest.model_format, self.device, 1, options, manifest=manifest
                        )
                        for batch in BATCHES:
                            x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
                            figure = _in_process(backend, x, self.seconds / 2)
                            figures[f"{fmt}{suffix}_b{batch}"] = figure
                    except Exception as exc:
                        failed.append(f"{fmt}{suffix}")
                        figures[f"{fmt}{suffix}_error"] = f"{type(exc).__name__}: {exc}"
        figures["onnx_cuda"] = _onnx_cuda_note()
        self.in_process = figures
        if failed:
            raise StepFailed(f"in-process runs failed: {', '.join(failed)}", figures)
        return figures

    # -- served -----------------------------------------------------------------------------------
    def served(self) -> dict[str, Any]:
        """Each model in a server of its own (a model that brings its server down does not hide
        the other's result): answers checked, batching read from /metrics, and the `.pt2`'s
        throughput served at batch 64."""
        import numpy as np

        rows = np.random.default_rng(0).standard_normal((64, FEATURES)).astype(np.float32)
        expected = _reference(rows)
        found: dict[str, Any] = {}
        failed: list[str] = []
        for model in ("mlp_ts", "mlp_pt2"):
            try:
                found[model] = self._served_model(model, rows, expected)
            except Exception as exc:
                failed.append(model)
                found[model] = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
                traceback.print_exc()
        if failed:
            raise StepFailed(f"served: {', '.join(failed)} failed", found)
        return found

    def _served_model(self, model: str, rows: Any, expected: Any) -> dict[str, Any]:
        import numpy as np

        checked: dict[str, Any] = {}
        with self._server(model) as server:
            for how, got in (
                ("rest", asyncio.run(_rest_answers(server.url, model, rows))),
                ("grpc", _grpc_answers(server.grpc_address, model, rows)),
            ):
                worst = float(np.abs(got - expected).max())
                if worst > TOLERANCE:
                    raise RuntimeError(f"{model} over {how}: off by {worst:.2e} from the CPU")
                checked[f"{how}_max_diff"] = worst
            total, batches = server.batch_counts()
            checked["mean_batch"] = round(total / batches, 2) if batches else 0.0
            if checked["mean_batch"] <= 1.0:
                raise RuntimeError("the 128 concurrent requests were never batched together")
            if model == "mlp_pt2":
                served = _served_items(server.grpc_address, model, 64, self.seconds)
                inprocess = self.in_process.get("pt2_b64", {}).get("items_per_s")
                checked["served_b64"] = {
                    "items_per_s": served,
                    "of_in_process": round(served / inprocess, 3) if inprocess else None,
                }
        return checked

    def _server(self, model: str) -> Any:
        from benchmarks.servers import ServerProcess, free_ports

        port, mgmt, metrics, grpc, grpc_mgmt = free_ports(5)
        argv = [
            sys.executable, "-m", "scriptserve", "serve", "--model-store", str(self.store),
            "--models", f"{model}.mar",
            "--device", "cuda" if self.device.startswith("cuda") else "cpu",
            "--inference-address", f"127.0.0.1:{port}",
            "--management-address", f"127.0.0.1:{mgmt}",
            "--metrics-address", f"127.0.0.1:{metrics}",
            "--grpc-inference-address", f"127.0.0.1:{grpc}",
            "--grpc-management-address", f"127.0.0.1:{grpc_mgmt}",
            "--workers", "1", "--max-batch-size", "64", "--max-batch-delay", "5",
            "--log-level", "warning",
        ]  # fmt: skip
        server = ServerProcess("gpu-check", argv, port, f"/v2/models/{model}/ready", {})
        server.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        server.grpc_address = f"127.0.0.1:{grpc}"
        return server


MODEL_FILE = f"""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear({FEATURES}, {HIDDEN}), nn.ReLU(), nn.Linear({HIDDEN}, {HIDDEN}), nn.ReLU(),
            nn.Linear({HIDDEN}, {CLASSES}),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
"""


def _pip(command: list[str], args: list[str]) -> None:
    """Run pip; where the Python is the distribution's (PEP 668: "externally managed"), again
    with --break-system-packages: a GPU machine used for this check is set up for it alone."""

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)

    done = run([*command, *args])
    if done.returncode != 0 and "externally-managed-environment" in done.stderr:
        done = run([*command, "--break-system-packages", *args])
    if done.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def _load_model(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check_mlp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MLP().eval()


def _reference(rows: Any) -> Any:
    import torch

    model = _load_model(WORK / "src" / "mlp.py")
    with torch.no_grad():
        return model(torch.from_numpy(rows)).numpy()


def _wait_ready(url: str, model: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/v2/models/{model}/ready", timeout=5).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{model} not ready in {timeout_s:g} s")
        time.sleep(0.1)


def _oip_body(row: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "shape": [1, FEATURES], "datatype": "FP32", "data": row.tolist()}]
    }


async def _rest_answers(url: str, model: str, rows: Any) -> Any:
    import httpx
    import numpy as np

    async with httpx.AsyncClient(timeout=60) as client:
        posts = [client.post(f"{url}/v2/models/{model}/infer", json=_oip_body(r)) for r in rows]
        answers = await asyncio.gather(*posts)
    for answer in answers:
        answer.raise_for_status()
    return np.array([a.json()["outputs"][0]["data"] for a in answers], dtype=np.float32)


def _grpc_request(model: str, rows: Any) -> Any:
    from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(rows.tobytes())
    return request


def _grpc_answers(address: str, model: str, rows: Any) -> Any:
    import grpc
    import numpy as np

    from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as rpc

    with grpc.insecure_channel(address) as channel:
        stub = rpc.GRPCInferenceServiceStub(channel)
        with ThreadPoolExecutor(64) as pool:
            calls = [
                stub.ModelInfer.future(_grpc_request(model, r[None]), timeout=60) for r in rows
            ]
            replies = list(pool.map(lambda c: c.result(), calls))
    return np.stack([np.frombuffer(r.raw_output_contents[0], np.float32) for r in replies])


def _in_process(backend: Any, x: Any, seconds: float) -> dict[str, float]:
    """Median seconds per call over `seconds` of calls (after 3 warm ones), and items/s."""
    for _ in range(3):
        backend.run({"x": x})
    times = []
    until = time.perf_counter() + seconds
    while time.perf_counter() < until or len(times) < 5:
        started = time.perf_counter()
        backend.run({"x": x})
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"median_ms": round(median * 1e3, 3), "items_per_s": round(len(x) / median, 1)}


def _served_items(address: str, model: str, batch: int, seconds: float) -> float:
    """Items per second answered to 4 gRPC clients sending `batch` rows per request: each
    client's rate over the same `seconds`, begun once every client has a warm connection (a
    first call that outlasts a short window must not leave it empty), and at least one call
    each."""
    import grpc
    import numpy as np

    from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as rpc

    rows = np.random.default_rng(2).standard_normal((batch, FEATURES)).astype(np.float32)
    request = _grpc_request(model, rows)
    clients = 4
    warm = threading.Barrier(clients)

    def client(_: int) -> float:
        with grpc.insecure_channel(address) as channel:
            stub = rpc.GRPCInferenceServiceStub(channel)
            stub.ModelInfer(request, timeout=60)  # a warm connection before the clock
            warm.wait(timeout=120)
            started, done = time.perf_counter(), 0
            while True:
                stub.ModelInfer(request, timeout=60)
                done += batch
                elapsed = time.perf_counter() - started
                if elapsed >= seconds:
                    return done / elapsed

    with ThreadPoolExecutor(clients) as pool:
        return round(sum(pool.map(client, range(clients))), 1)


def _onnx_cuda_note() -> str:
    if importlib.util.find_spec("onnxruntime") is None:
        return "not measured: onnxruntime is not installed"
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return (
            "not measured: this onnxruntime is the CPU build (onnxruntime-gpu, the gpu extra, "
            "is larger than what may travel to the machine)"
        )
    return "not measured: ONNX export is not part of this check yet"


def prepare(out: Path, python: str = "3.12") -> int:
    """The wheels that travel to the GPU machine: TRAVEL's, for `python` (scriptserve's own is
    built there, from the tree that travels with them)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "-d",
            str(out),
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--abi",
            f"cp{python.replace('.', '')}",
            "--platform",
            "manylinux_2_28_x86_64",
            "--platform",
            "manylinux2014_x86_64",
            "--platform",
            "manylinux_2_17_x86_64",
            "--platform",
            "any",
            *TRAVEL,
        ],
        check=True,
    )
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {out}")
    if size > LIMIT_BYTES:
        print(f"more than the {LIMIT_BYTES / 2**20:.0f} MiB that may travel", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", type=Path, help="download the wheels that travel into DIR")
    p.add_argument("--python", default="3.12", help="--prepare's Python version; default 3.12")
    p.add_argument("--wheels", type=Path, help="install from these wheels first")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU")
    p.add_argument("--seconds", type=float, default=4.0, help="per measurement; default 4")
    p.add_argument("--out", type=Path, help="results file (default: see the module)")
    p.add_argument(
        "--logs",
        type=Path,
        default=WORK,
        help="the tests' report; default " + str(WORK.relative_to(REPO)),
    )
    p.add_argument(
        "--no-tests", action="store_true", help="leave out the GPU tests (the longest step)"
    )
    args = p.parse_args(argv)
    if args.prepare is not None:
        return prepare(args.prepare, args.python)
    check = Check(args.dry_run, args.wheels, args.seconds)
    check.logs = args.logs
    check.out = args.out or (
        WORK / "gpu-dry-run.json" if args.dry_run else RESULTS / f"gpu-{check.when}.json"
    )
    WORK.mkdir(parents=True, exist_ok=True)
    return stoppable(check, lambda: _steps(check, args))


def stoppable(check: Check, steps: Callable[[], int]) -> int:
    """What `steps()` returns, unless SIGTERM stops them: then the step that ran is recorded as
    stopped, what it started is ended, the results file says how far the check got, and the
    exit code is 143, as for a process SIGTERM ends."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return steps()
    except Stopped as stopped:
        _end_children()
        print(f"[gpu-check] {stopped}; results: {check.out}", flush=True)
        assert check.out is not None
        check.write(check.out)
        return 128 + signal.SIGTERM


def _end_children(grace_s: float = 10.0) -> None:
    """End the child processes a stopped step's own cleanup did not reach: a command that
    SIGTERM caught between its fork and its exec, before `subprocess.Popen` returned it to
    anything that would kill it. SIGTERM, then SIGKILL after `grace_s`; each one reaped."""
    children = _children()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pid in children:
        while not _reaped(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _reaped(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped already (by a Popen that did get it)
        return True


def _children() -> list[int]:
    """This process's child processes, from /proc (no psutil: the check runs before it
    installs anything)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():  # state, then the parent
            found.append(int(entry.name))
    return found


def _steps(check: Check, args: argparse.Namespace) -> int:
    """The steps in their order (see the module); 0 when every step was ok."""
    # Installing comes first: torch, once imported, would not see a numpy installed after it.
    check.step("install", check.install)
    check.step("environment", check.environment)
    if not (check.steps["install"]["ok"] and check.steps["environment"]["ok"]):
        return _write(check, args)
    check.step("archives", check.make_archives)
    if check.steps["archives"]["ok"]:
        check.step("loads", check.loads)
        check.step("benchmark", check.benchmark)
        check.step("served", check.served)
    if not args.no_tests:
        check.step("tests", check.tests)
    return _write(check, args)


def _write(check: Check, args: argparse.Namespace) -> int:
    """The results file, once more at the end; 0 when every step was ok."""
    assert check.out is not None
    ok = check.write(check.out)
    print(f"[gpu-check] results: {check.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
