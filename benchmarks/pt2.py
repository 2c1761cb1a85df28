"""`.pt2` (torch.export + AOTInductor) against TorchScript, int8 `.pt2` against fp32, one run.

    python -m benchmarks.pt2 [--quick] [--rounds 3] [--seconds 10]

- **Served**: scenario A (the MLP, one JSON row per request) and B (the small CNN), each model
  as a TorchScript archive and as a `.pt2` archive compiled from the same weights, served in
  turn by `scriptserve serve` with the scenarios' settings (workers = CPU count, 1 intra-op
  thread, batching up to 32 with no delay) and loaded by wrk with 32 connections. Ratios
  (`.pt2` / TorchScript) are taken within each round; medians over rounds.
- **int8**: the MLP as a dynamic-int8 `.pt2` (torchao's PT2E flow) and as a static-int8 one
  (ranges calibrated on 512 random rows): archive size, in-process latency at batch 1, 32 and
  64 against the fp32 `.pt2` (medians of alternating calls on one
  thread, through the C ABI the server uses), served req/s against the fp32 `.pt2` (same
  settings, alternating), top-1 agreement on 1,000 random rows.
- **Cold start**: process start (`python -m scriptserve serve`) to the first 200 of a
  prediction, for the `.pt2` and the TorchScript MLP archives; medians of `--cold-runs` runs.

Targets (issue "PT2 archives"): served `.pt2` >= 1.0x TorchScript at no higher p99 in A and B;
int8 `.pt2` >= 3x faster than fp32 `.pt2` at batch 32 and >= 1.3x its served req/s, archive
>= 2x smaller; cold start <= 2 s. Writes benchmarks/results/pt2-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import models, report
from benchmarks.loadgen import run_wrk
from benchmarks.servers import REPO, free_port, scriptserve
from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.pt2_check import PackageRunner

BATCHES = (1, 32, 64)
"""Batch sizes of the in-process int8 latencies (the target is at 32)."""
MAX_BATCH = 64
"""Rows the `.pt2` packages take at most (the server batches up to 32)."""


def pt2_archive(name: str, store: Path, workdir: Path, *extra: str) -> Path:
    """`name` (benchmarks/models.py) as a `.pt2` archive: the same seed-0 weights as its
    TorchScript archive, exported and compiled by model-archiver."""
    cls, _ = models._MODELS[name]
    torch.manual_seed(0)
    weights = workdir / f"{name}-weights.pt"
    torch.save(cls().state_dict(), weights)
    label = f"{name}_pt2" + ("_int8" if extra else "")
    argv = [
        "--model-name", name, "--version", "1.0", "--export-pt2",
        "--model-file", str(Path(models.__file__)), "--model-class", cls.__name__,
        "--serialized-file", str(weights), "--sample-input", str(workdir / f"{name}.json"),
        "--handler", "tensor", "--max-batch", str(MAX_BATCH), "--export-path", str(store), "-f",
        *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        assert model_archiver_main(argv) == 0, f"model-archiver failed for {label}"
    print(f"  {label}: archived in {time.perf_counter() - started:.1f} s", flush=True)
    return store / f"{name}.mar"


def served(store: Path, name: str, body: Path, seconds: float, warmup: float) -> dict[str, float]:
    workers = os.cpu_count() or 1
    with scriptserve(f"{store.name}/{name}", store, name, workers, 1, 32) as server:
        url = f"{server.url}/predictions/{name}"
        run_wrk(url, 32, warmup, 2, body)
        result = run_wrk(url, 32, seconds, 2, body)
    if result.errors:
        raise RuntimeError(f"{result.errors} failed requests against {store.name}/{name}")
    return {"rps": result.rps, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms}


def alternate(variants: dict[str, Callable[[], dict[str, float]]], rounds: int) -> dict[str, Any]:
    """Each variant once per round, in turn; per-round ratios of the second to the first."""
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    for _ in range(rounds):
        for key, measure in variants.items():
            runs[key].append(measure())
    first, second = list(variants)
    ratios = [b["rps"] / a["rps"] for a, b in zip(runs[first], runs[second], strict=True)]
    return {
        "runs": runs,
        "median_rps": {k: statistics.median(r["rps"] for r in v) for k, v in runs.items()},
        "median_p99_ms": {k: statistics.median(r["p99_ms"] for r in v) for k, v in runs.items()},
        "ratio_per_round": ratios,
        "ratio": statistics.median(ratios),
    }


def latency_ms(fp32: PackageRunner, int8: PackageRunner, x: np.ndarray, runs: int) -> list[float]:
    for _ in range(20):
        fp32({"x": x}), int8({"x": x})
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for runner, out in ((fp32, times[0]), (int8, times[1])):
            started = time.perf_counter()
            runner({"x": x})
            out.append((time.perf_counter() - started) * 1e3)
    return [statistics.median(times[0]), statistics.median(times[1])]


def package_of(archive: Path, workdir: Path, label: str) -> Path:
    with open_archive(archive) as reader:
        target = workdir / f"{label}.pt2"
        target.write_bytes(
            (reader.root / (reader.manifest.model.serialized_file or "")).read_bytes()
        )
    return target


def int8_in_process(fp32: Path, int8: Path, workdir: Path, runs: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    a = PackageRunner(package_of(fp32, workdir, "fp32"), threads=1)
    b = PackageRunner(package_of(int8, workdir, "int8"), threads=1)
    rng = np.random.default_rng(0)
    found: dict[str, Any] = {}
    for batch in BATCHES:
        x = rng.standard_normal((batch, 512)).astype(np.float32)
        f, i = latency_ms(a, b, x, runs)
        found[f"latency_ms_batch{batch}"] = {"fp32": f, "int8": i, "ratio": f / i}
    x = rng.standard_normal((1000, 512)).astype(np.float32)
    top = [
        np.concatenate(
            [r({"x": x[j : j + MAX_BATCH]})["output0"] for j in range(0, 1000, MAX_BATCH)]
        )
        for r in (a, b)
    ]
    found["top1_agreement"] = float(np.mean(top[0].argmax(1) == top[1].argmax(1)))
    found["max_abs_diff"] = float(np.max(np.abs(top[0] - top[1])))
    a.close()
    b.close()
    return found


def cold_start_s(store: Path, name: str, body: bytes) -> float:
    """Seconds from spawning the server to the first 200 of a prediction."""
    port = free_port()
    argv = [
        sys.executable, "-m", "scriptserve", "serve", "--model-store", str(store),
        "--models", "all", "--device", "cpu", "--log-level", "warning",
        "--inference-address", f"127.0.0.1:{port}",
        *(f"--{k}-address=127.0.0.1:{free_port()}"
          for k in ("management", "metrics", "grpc-inference", "grpc-management")),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}/predictions/{name}"
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - started < 60:
            if proc.poll() is not None:
                raise RuntimeError(f"the server for {store} exited {proc.returncode}")
            request = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.01)
        raise TimeoutError(f"no 200 from {url} within 60 s")
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round of 3 s runs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--cold-runs", type=int, default=5)
    p.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    args = p.parse_args(argv)
    rounds, seconds, warmup = (1, 3.0, 1.0) if args.quick else (args.rounds, args.seconds, 2.0)
    load_before = os.getloadavg()
    result: dict[str, Any] = {"cpus": os.cpu_count(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="bench-pt2-") as tmp:
        work = Path(tmp)
        print("building archives", flush=True)
        stores = {k: work / k for k in ("ts_a", "ts_b", "pt2_a", "pt2_b", "int8_a")}
        mlp = models.build("mlp", work, stores["ts_a"])
        cnn = models.build("cnn", work, stores["ts_b"])
        pt2_mlp = pt2_archive("mlp", stores["pt2_a"], work)
        pt2_cnn = pt2_archive("cnn", stores["pt2_b"], work)
        validation = work / "validation.npz"
        rng = np.random.default_rng(1)
        np.savez(validation, x=rng.standard_normal((512, 512)).astype(np.float32))
        int8_mlp = pt2_archive(
            "mlp",
            stores["int8_a"],
            work,
            "--quantize",
            "dynamic-int8",
            "--validation-file",
            str(validation),
        )
        static_mlp = pt2_archive(
            "mlp",
            work / "static_a",
            work,
            "--quantize",
            "static-int8",
            "--validation-file",
            str(validation),
        )
        sizes = {
            k: v.stat().st_size
            for k, v in {
                "torchscript_mlp": mlp.archive,
                "pt2_mlp": pt2_mlp,
                "int8_pt2_mlp": int8_mlp,
                "torchscript_cnn": cnn.archive,
                "pt2_cnn": pt2_cnn,
            }.items()
        }
        result["archive_bytes"] = sizes

        for key, model, ts, pt in (("A", mlp, "ts_a", "pt2_a"), ("B", cnn, "ts_b", "pt2_b")):
            print(f"served scenario {key}: TorchScript vs .pt2", flush=True)
            result[f"served_{key}"] = alternate(
                {
                    "torchscript": lambda m=model, s=ts: served(  # type: ignore[misc]
                        stores[s], m.name, m.body, seconds, warmup
                    ),
                    "pt2": lambda m=model, s=pt: served(  # type: ignore[misc]
                        stores[s], m.name, m.body, seconds, warmup
                    ),
                },
                rounds,
            )

        print("int8 .pt2 vs fp32 .pt2", flush=True)
        int8 = int8_in_process(pt2_mlp, int8_mlp, work, 300 if args.quick else 2000)
        int8["size_ratio"] = sizes["pt2_mlp"] / sizes["int8_pt2_mlp"]
        int8["served"] = alternate(
            {
                "fp32": lambda: served(stores["pt2_a"], "mlp", mlp.body, seconds, warmup),
                "int8": lambda: served(stores["int8_a"], "mlp", mlp.body, seconds, warmup),
            },
            rounds,
        )
        result["int8"] = int8
        static = int8_in_process(pt2_mlp, static_mlp, work, 300 if args.quick else 2000)
        static["size_ratio"] = sizes["pt2_mlp"] / static_mlp.stat().st_size
        result["int8_static"] = static

        print("cold start", flush=True)
        body = mlp.body.read_bytes()
        cold: dict[str, list[float]] = {"pt2": [], "torchscript": []}
        for _ in range(1 if args.quick else args.cold_runs):
            cold["pt2"].append(cold_start_s(stores["pt2_a"], "mlp", body))
            cold["torchscript"].append(cold_start_s(stores["ts_a"], "mlp", body))
        result["cold_start_s"] = {
            "runs": cold,
            "median": {k: statistics.median(v) for k, v in cold.items()},
        }
    result["host"] = report.host(load_before)
    show(result)
    print(report.host_line(result["host"]))
    if args.output is None:
        report.write_results("pt2", result)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def show(r: dict[str, Any]) -> None:
    print(f"\n== .pt2 benchmark ({r['cpus']} CPUs, torch {r['torch']})")
    for key in ("A", "B"):
        s = r[f"served_{key}"]
        rps, p99 = s["median_rps"], s["median_p99_ms"]
        print(
            f"scenario {key}: TorchScript {rps['torchscript']:7.0f} r/s p99 "
            f"{p99['torchscript']:6.2f} ms | .pt2 {rps['pt2']:7.0f} r/s p99 {p99['pt2']:6.2f} ms"
            f" | .pt2/TorchScript {s['ratio']:.2f}x (per round "
            f"{', '.join(f'{x:.2f}' for x in s['ratio_per_round'])})"
        )
    i = r["int8"]
    for scheme, found in (("dynamic", i), ("static", r["int8_static"])):
        for batch in BATCHES:
            lat = found[f"latency_ms_batch{batch}"]
            print(
                f"{scheme} int8 batch {batch:<2}: fp32 {lat['fp32']:.3f} ms, int8 "
                f"{lat['int8']:.3f} ms, {lat['ratio']:.2f}x faster (medians, 1 thread)"
            )
    static = r["int8_static"]
    print(
        f"static int8: archive {static['size_ratio']:.2f}x smaller; top-1 agreement "
        f"{static['top1_agreement']:.3f} (not served: scenario A's path bounds it)"
    )
    s = i["served"]
    print(
        f"int8 served: fp32 {s['median_rps']['fp32']:.0f} r/s, int8 "
        f"{s['median_rps']['int8']:.0f} r/s, {s['ratio']:.2f}x; archive "
        f"{i['size_ratio']:.2f}x smaller; top-1 agreement {i['top1_agreement']:.3f}"
    )
    c = r["cold_start_s"]["median"]
    print(
        f"cold start (spawn to first 200): .pt2 {c['pt2']:.2f} s, TorchScript "
        f"{c['torchscript']:.2f} s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
