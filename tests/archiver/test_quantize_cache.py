"""archiver/quantize_cache.py: the load-time int8 cache shared by server replicas and threads.

Replicas that read one model store share one cache directory; the entry for a model must be
converted once, by whichever process gets there first, and reused by the others."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from testmodels import reference_output, save_onnx, save_torchscript

from scriptserve.archiver.archive import sha256_file
from scriptserve.archiver.quantize import QuantizationError, QuantizeOptions, Tolerance
from scriptserve.archiver.quantize_cache import LoadRequest, load_request, quantize_cached

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

X = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
SAMPLE = {"x": X[:1]}
TOLERANCE = 0.05

# One server replica's load-time quantization: it imports everything first, says "ready", and
# converts when the test writes a line to its stdin, so that every replica starts together.
REPLICA = """
import json, logging, sys
from pathlib import Path

import numpy as np
import torch  # imported before "ready": the replicas then start converting at the same moment

from scriptserve.archiver.quantize_cache import LoadRequest, quantize_cached

logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
src, cache = Path(sys.argv[1]), Path(sys.argv[2])
sample = {"x": np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)[:1]}
print("ready", flush=True)
sys.stdin.readline()
path, report = quantize_cached(src, "torchscript", cache, sample, LoadRequest())
print(json.dumps({"path": str(path), "report": report.to_dict()}), flush=True)
"""


def _run_torchscript(path: Path, x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(path)).eval()  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]


def _start_replica(src: Path, cache: Path, log: Path) -> subprocess.Popen[str]:
    with log.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", REPLICA, str(src), str(cache)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def _without_cached(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "cached"}


def test_load_request_reads_config_and_registration() -> None:
    assert load_request({}) is None
    assert load_request({"quantize": "none"}) is None
    config = {"quantize": "dynamic-int8", "quantizeMinTop1Agreement": 0.9, "quantizeMaxAbsDiff": 1}
    request = load_request(config)
    assert request is not None
    assert request.tolerance == Tolerance(min_top1_agreement=0.9, max_abs_diff=1.0)
    assert load_request({}, "dynamic-int8") is not None  # the registration parameter wins
    with pytest.raises(QuantizationError, match="use one of none, dynamic-int8"):
        load_request({}, "int4")
    with pytest.raises(QuantizationError, match="invalid quantize setting"):
        load_request({"quantize": "dynamic-int8", "quantizeMaxAbsDiff": "lots"})


def test_cache_is_reused_and_keyed_by_options(tmp_path: Path) -> None:
    src = save_torchscript(tmp_path / "tiny.pt")
    cache = tmp_path / "cache"
    first, report = quantize_cached(src, "torchscript", cache, SAMPLE, LoadRequest())
    assert not report.cached and first.name.startswith(sha256_file(src))
    mtime = first.stat().st_mtime_ns
    again, cached = quantize_cached(src, "torchscript", cache, SAMPLE, LoadRequest())
    assert (again, cached.cached, again.stat().st_mtime_ns) == (first, True, mtime)
    assert cached.size_ratio == report.size_ratio
    other = LoadRequest(QuantizeOptions(per_channel=True))
    third, fresh = quantize_cached(src, "torchscript", cache, SAMPLE, other)
    assert third != first and not fresh.cached
    # A damaged entry is converted again, not served.
    first.write_bytes(b"damaged")
    _, redone = quantize_cached(src, "torchscript", cache, SAMPLE, LoadRequest())
    assert not redone.cached
    assert sha256_file(first) == redone.int8_sha256


def test_replicas_sharing_a_cache_convert_once(tmp_path: Path) -> None:
    src = save_torchscript(tmp_path / "tiny.pt")
    cache = tmp_path / "cache"
    replicas = [_start_replica(src, cache, tmp_path / f"replica{i}.log") for i in range(2)]
    try:
        for proc in replicas:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for proc in replicas:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=120)[0] for proc in replicas]
    finally:
        for proc in replicas:
            proc.kill()
            proc.wait()
    logs = "".join((tmp_path / f"replica{i}.log").read_text() for i in range(2))
    assert [proc.returncode for proc in replicas] == [0, 0], logs
    results = [json.loads(out) for out in outputs]

    # One replica converted; the other waited for it and served its entry.
    assert sorted(r["report"]["cached"] for r in results) == [False, True], logs
    assert logs.count("converted tiny.pt to dynamic int8") == 1, logs
    assert logs.count("loaded from the cache") == 1, logs
    # Every replica serves the same file, and it is the file the report describes.
    paths = {Path(r["path"]) for r in results}
    assert len(paths) == 1
    served = paths.pop()
    reports = [_without_cached(r["report"]) for r in results]
    assert reports[1:] == reports[:-1]
    assert reports[0]["int8_sha256"] == sha256_file(served)
    assert reports[0]["quantized_ops"] == {"quantized::linear_dynamic": 2}
    assert np.max(np.abs(_run_torchscript(served, X) - reference_output(X))) < TOLERANCE
    # No temporary file is left behind: only the entry (model + report) and its lock.
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".lock", ".pt"]


def test_threads_sharing_a_cache_convert_once(tmp_path: Path) -> None:
    src = save_onnx(tmp_path / "tiny.onnx")
    cache = tmp_path / "cache"
    start = threading.Barrier(3)
    results: list[tuple[Path, bool, str]] = []
    errors: list[BaseException] = []

    def load() -> None:
        start.wait(timeout=30)
        try:
            path, report = quantize_cached(src, "onnx", cache, SAMPLE, LoadRequest())
            results.append((path, report.cached, report.int8_sha256))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert sorted(cached for _, cached, _ in results) == [False, True, True]
    assert len({(path, sha) for path, _, sha in results}) == 1
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".lock", ".onnx"]
