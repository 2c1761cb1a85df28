"""TorchServe 0.12 serving a zoo model, at its best configuration: the model's TorchScript file
packed by torch-model-archiver with a Pillow or `tokenizers` handler
(benchmarks/baselines/torchserve_*_handler.py), registered with 1 and 2 workers and batches of
1 and 8 in turn, loaded by wrk as scriptserve is (benchmarks/zoo.py); the best run is kept.

Needs `pip install torchserve==0.12.0` and Java 17 (TorchServe's front end is a JVM).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.loadgen import STEADY_WARMUP_S, steady_load
from benchmarks.servers import free_ports

BASELINES = Path(__file__).resolve().parent / "baselines"
CONFIGURATIONS = ((1, 8), (2, 8), (2, 1))
"""(workers, batch size) tried; TorchServe's own guidance is one worker per core or fewer."""
CONNECTIONS = (8, 32)
"""Keep-alive clients of one request each, tried for every configuration (by the zoo's served
runs too): 8 fill one batch of 8; 32 keep a full batch queued behind each of two workers'
running ones, what a server needs to run full batches back to back (the figure of a server
at saturation, where latency is the queue's)."""


def available() -> str | None:
    """Why TorchServe cannot run here, or None."""
    if shutil.which("torchserve") is None:
        return "torchserve is not installed: pip install torchserve==0.12.0"
    if shutil.which("java") is None:
        return "TorchServe needs Java 17: apt-get install openjdk-17-jre-headless"
    return None


def _call(method: str, url: str, timeout: float = 300.0) -> int:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0  # not listening (yet)


def _archive(
    name: str, torchscript: Path, kind: str, extra: list[Path], inputs: list[str], store: Path
) -> Path:
    work = store.parent / "ts-src"
    work.mkdir(exist_ok=True)
    handler = BASELINES / f"torchserve_{kind}_handler.py"
    (work / "inputs.json").write_text(json.dumps(inputs))
    files = [*extra, work / "inputs.json"]
    subprocess.run(
        [
            "torch-model-archiver",
            "--model-name",
            name,
            "--version",
            "1.0",
            "--serialized-file",
            str(torchscript),
            "--handler",
            str(handler),
            "--extra-files",
            ",".join(str(f) for f in files),
            "--export-path",
            str(store),
            "-f",
        ],
        check=True,
        capture_output=True,
    )
    return store / f"{name}.mar"


def best_rate(
    name: str,
    torchscript: Path,
    kind: str,
    extra: list[Path],
    inputs: list[str],
    body: Path,
    headers: dict[str, str],
    seconds: float,
) -> dict[str, Any]:
    """TorchServe's best served figure for the model, and every configuration's."""
    with tempfile.TemporaryDirectory(prefix="torchserve-") as tmp:
        root = Path(tmp)
        store = root / "store"
        store.mkdir()
        _archive(name, torchscript, kind, extra, inputs, store)
        ports = free_ports(3)
        config = root / "config.properties"
        config.write_text(
            f"inference_address=http://127.0.0.1:{ports[0]}\n"
            f"management_address=http://127.0.0.1:{ports[1]}\n"
            f"metrics_address=http://127.0.0.1:{ports[2]}\n"
            "disable_token_authorization=true\nenable_model_api=true\n"
            "install_py_dep_per_model=false\ndefault_response_timeout=300\n"
        )
        log = (root / "ts.log").open("wb")
        proc = subprocess.Popen(
            [
                "torchserve",
                "--start",
                "--foreground",
                "--ncs",
                "--model-store",
                str(store),
                "--ts-config",
                str(config),
                "--disable-token-auth",
                "--enable-model-api",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
        inference = f"http://127.0.0.1:{ports[0]}"
        management = f"http://127.0.0.1:{ports[1]}"
        try:
            deadline = time.monotonic() + 120
            while _call("GET", f"{inference}/ping", 2) != 200:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(
                        f"TorchServe did not start:\n{(root / 'ts.log').read_text()}"
                    )
                time.sleep(0.5)
            runs = []
            for workers, batch in CONFIGURATIONS:
                query = f"batch_size={batch}&max_batch_delay=5&initial_workers={workers}"
                url = f"{management}/models?url={name}.mar&{query}&synchronous=true"
                if _call("POST", url) != 200:
                    raise RuntimeError(f"TorchServe did not register {name}")
                predict = f"{inference}/predictions/{name}"
                for connections in CONNECTIONS:
                    load = steady_load(
                        predict, connections, STEADY_WARMUP_S, seconds, body.read_bytes(), headers
                    )
                    runs.append(
                        {
                            "workers": workers,
                            "batch": batch,
                            "connections": connections,
                            "items_s": load.rps,
                            "p50_ms": load.p50_ms,
                            "p99_ms": load.p99_ms,
                            "errors": load.errors,
                        }
                    )
                _call("DELETE", f"{management}/models/{name}/1.0")
        finally:
            # The launcher's JVM outlives it unless TorchServe is told to stop.
            subprocess.run(["torchserve", "--stop"], capture_output=True, check=False)
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    clean = [r for r in runs if not r["errors"]] or runs
    best = max(clean, key=lambda r: r["items_s"])
    return {**best, "runs": runs}
