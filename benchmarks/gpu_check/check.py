"""The gpu check's steps and their record (see the package): each step timed, a failed one
recorded with what it found, and the results file rewritten after each."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.mlp import (
    MODEL_FILE,
    grpc_answers,
    load_model,
    onnx_cuda_note,
    reference,
    rest_answers,
    served_items,
    timed_calls,
)
from benchmarks.gpu_check.plan import BATCHES, FEATURES, GPU_TESTS, REPO, TOLERANCE, WORK
from benchmarks.gpu_check.stopping import Stopped
from benchmarks.gpu_check.travel import TRAVEL, pip_install


class StepFailed(RuntimeError):
    """A step that failed with findings worth keeping in its record."""

    def __init__(self, message: str, found: dict[str, Any]) -> None:
        super().__init__(message)
        self.found = found


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
        pip_install(pip, TRAVEL)
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
        pip_install(pip, ["--no-deps", "--force-reinstall", str(wheel)])
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
        module = load_model(src / "mlp.py")
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
        variants: list[tuple[str, dict[str, Any]]] = [("", {})]
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
                            figure = timed_calls(backend, x, self.seconds / 2)
                            figures[f"{fmt}{suffix}_b{batch}"] = figure
                    except Exception as exc:
                        failed.append(f"{fmt}{suffix}")
                        figures[f"{fmt}{suffix}_error"] = f"{type(exc).__name__}: {exc}"
        figures["onnx_cuda"] = onnx_cuda_note()
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
        expected = reference(rows)
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
                ("rest", asyncio.run(rest_answers(server.url, model, rows))),
                ("grpc", grpc_answers(server.grpc_address, model, rows)),
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
                served = served_items(server.grpc_address, model, 64, self.seconds)
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
