"""fp32 vs dynamic int8 in one run: archive size, in-process latency, served throughput, top-1.

    python -m benchmarks.quantize [--quick] [--digits-archive model_store/digits.mar]

Models: scenario A's MLP (512 -> 1024 -> 1024 -> 10, benchmarks/models.py), and with
`--digits-archive` the trained digits model (accuracy on the archive's validation samples).
In-process latency: medians of alternating fp32/int8 calls on one intra-op thread, at batch 1
and 32. Served: a real `scriptserve serve` per variant (1 worker, 1 thread, max batch 32), loaded
by wrk with 16 connections posting one row to /predictions; fp32 and int8 alternate, medians.
Targets on the MLP: >= 3.5x smaller, >= 2x faster at batch 32, served req/s not lower than fp32.
Writes benchmarks/results/quantize-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import models, report
from benchmarks.loadgen import run_wrk
from benchmarks.servers import scriptserve
from scriptserve.archiver.archive import ArchiveSpec, build_archive, list_files, open_archive
from scriptserve.archiver.manifest import MANIFEST_PATH
from scriptserve.archiver.quantize import (
    QuantizeOptions,
    Tolerance,
    ValidationSamples,
    quantize_model_file,
)
from scriptserve.archiver.quantize_cache import archive_samples

Runner = Callable[[np.ndarray], np.ndarray]


def int8_archive(fp32: Path, store: Path) -> Path:
    """The fp32 archive's files with its model replaced by the dynamic-int8 one."""
    with open_archive(fp32) as reader, tempfile.TemporaryDirectory() as tmp:
        manifest, root = reader.manifest, reader.root
        assert manifest.scriptserve is not None and manifest.model.serialized_file
        src = root / manifest.model.serialized_file
        sample, validation = archive_samples(root, manifest)
        assert sample is not None, "the archive has no sample input"
        dst = Path(tmp) / f"{src.stem}.int8{src.suffix}"
        # Measure, never refuse: the benchmark reports accuracy itself.
        report = quantize_model_file(
            src,
            dst,
            manifest.model_format,
            sample,
            QuantizeOptions(),
            validation,
            Tolerance(min_top1_agreement=0.0, max_accuracy_drop=1.0),
        )
        files = {n: p for n, p in list_files(root).items() if n not in (MANIFEST_PATH, src.name)}
        files[dst.name] = dst
        manifest = replace(manifest, model=replace(manifest.model, serialized_file=dst.name))
        info = replace(manifest.scriptserve, quantization=report.manifest_entry("archive"))
        return build_archive(ArchiveSpec(manifest.with_scriptserve(info), files), store)


def _runner(path: Path, fmt: str) -> Runner:
    if fmt == "onnx":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]  # type: ignore[no-any-return]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(path)).eval()  # type: ignore[no-untyped-call]

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]

    return run


def latency_ms(fp32: Runner, int8: Runner, x: np.ndarray, runs: int) -> tuple[float, float]:
    for _ in range(20):
        fp32(x), int8(x)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for runner, out in ((fp32, times[0]), (int8, times[1])):
            started = time.perf_counter()
            runner(x)
            out.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[0]), statistics.median(times[1])


def served_rps(store: Path, name: str, body: Path, seconds: float) -> float:
    with scriptserve(f"{name}@{store.name}", store, name, 1, 1, 32) as server:
        url = f"{server.url}/predictions/{name}"
        run_wrk(url, 16, 1.0, 2, body)
        result = run_wrk(url, 16, seconds, 2, body)
        if result.errors:
            raise RuntimeError(f"{result.errors} failed requests against {name}")
        return result.rps


def compare(name: str, fp32_archive: Path, workdir: Path, quick: bool) -> dict[str, Any]:
    stores = {"fp32": fp32_archive.parent, "int8": workdir / "int8"}
    archives = {"fp32": fp32_archive, "int8": int8_archive(fp32_archive, stores["int8"])}
    result: dict[str, Any] = {"model": name}
    runners: dict[str, Runner] = {}
    with open_archive(archives["int8"]) as reader:
        q = reader.manifest.scriptserve.quantization  # type: ignore[union-attr]
        result["manifest"] = q.to_dict()
    readers = {k: open_archive(p) for k, p in archives.items()}
    try:
        fmt = readers["fp32"].manifest.model_format
        for key, reader in readers.items():
            runners[key] = _runner(reader.root / (reader.manifest.model.serialized_file or ""), fmt)
        sample, validation = archive_samples(readers["fp32"].root, readers["fp32"].manifest)
        assert sample is not None
        row = next(iter(sample.values())).astype(np.float32)
        torch.set_num_threads(1)
        result["archive_bytes"] = {k: p.stat().st_size for k, p in archives.items()}
        result["size_ratio"] = result["archive_bytes"]["fp32"] / result["archive_bytes"]["int8"]
        for batch in (1, 32):
            x = np.repeat(row, batch, axis=0)
            f, i = latency_ms(runners["fp32"], runners["int8"], x, 200 if quick else 1000)
            result[f"latency_ms_batch{batch}"] = {"fp32": f, "int8": i, "ratio": f / i}
        result["top1"] = top1(runners, validation, row.shape[1:])
        body = workdir / f"{name}.json"
        body.write_text(json.dumps(row[0].tolist()))
    finally:
        for reader in readers.values():
            reader.close()
    rps: dict[str, list[float]] = {"fp32": [], "int8": []}
    for _ in range(1 if quick else 3):
        for key in ("fp32", "int8"):
            rps[key].append(served_rps(stores[key], name, body, 3.0 if quick else 8.0))
    medians = {k: statistics.median(v) for k, v in rps.items()}
    result["served_rps"] = {**medians, "runs": rps, "ratio": medians["int8"] / medians["fp32"]}
    return result


def top1(
    runners: dict[str, Runner], validation: ValidationSamples | None, row_shape: tuple[int, ...]
) -> dict[str, Any]:
    """Accuracy on labelled samples; without labels, int8's agreement with fp32 on random rows."""
    if validation is not None:
        x = next(iter(validation.inputs.values())).astype(np.float32)
    else:
        x = np.random.default_rng(1).standard_normal((1000, *row_shape)).astype(np.float32)
    out = {
        k: np.concatenate([r(x[i : i + 256]) for i in range(0, len(x), 256)]).argmax(1)
        for k, r in runners.items()
    }
    found: dict[str, Any] = {
        "samples": len(x),
        "agreement": float(np.mean(out["fp32"] == out["int8"])),
    }
    if validation is not None and validation.labels is not None:
        found.update(
            {f"{k}_accuracy": float(np.mean(v == validation.labels)) for k, v in out.items()}
        )
    return found


def show(result: dict[str, Any]) -> None:
    b, r = result["archive_bytes"], result["served_rps"]
    print(f"== {result['model']}")
    print(
        f"archive   fp32 {b['fp32'] / 1e6:8.2f} MB  int8 {b['int8'] / 1e6:8.2f} MB  "
        f"{result['size_ratio']:.2f}x smaller"
    )
    for batch in (1, 32):
        lat = result[f"latency_ms_batch{batch}"]
        print(
            f"batch {batch:<3} fp32 {lat['fp32']:8.3f} ms  int8 {lat['int8']:8.3f} ms  "
            f"{lat['ratio']:.2f}x faster (medians, 1 thread)"
        )
    print(
        f"served    fp32 {r['fp32']:8.0f} r/s  int8 {r['int8']:8.0f} r/s  "
        f"int8/fp32 {r['ratio']:.2f} (medians of {len(r['runs']['fp32'])})"
    )
    print(f"top-1     {json.dumps(result['top1'])}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantize", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer runs, shorter loads")
    parser.add_argument("--digits-archive", type=Path, help="a trained digits archive (.mar)")
    parser.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        work = Path(tmp)
        mlp = models.build("mlp", work / "models", work / "fp32")
        results.append(compare("mlp", mlp.archive, work / "mlp", args.quick))
        show(results[-1])
        if args.digits_archive is not None:
            digits = work / "digits-fp32"
            digits.mkdir()
            copy = digits / args.digits_archive.name
            copy.write_bytes(args.digits_archive.read_bytes())
            with open_archive(copy) as reader:
                name = reader.manifest.model.model_name
            results.append(compare(name, copy, work / "digits", args.quick))
            show(results[-1])
    mlp_result = results[0]
    targets = {
        "size_ratio_ge_3.5": mlp_result["size_ratio"] >= 3.5,
        "batch32_speedup_ge_2": mlp_result["latency_ms_batch32"]["ratio"] >= 2.0,
        "served_rps_not_lower": mlp_result["served_rps"]["ratio"] >= 1.0,
    }
    print(f"MLP targets: {json.dumps(targets)}")
    host = report.host(load_before)
    print(report.host_line(host))
    document = {"quick": args.quick, "results": results, "mlp_targets": targets, "host": host}
    if args.output is None:
        report.write_results("quantize", document)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
