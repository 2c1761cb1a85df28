"""How long a process worker takes to start: a server's first workers, and a worker killed and
replaced, on this tree and optionally on another one (`--before <its python>`), in turn.

    python -m benchmarks.worker_starts [--before /tmp/before-py] [--rounds 3] [--kills 4]
        [--workers 2]

Each round starts one server per tree on a TorchScript MLP served by `--workers` process
workers (`SCRIPTSERVE_WORKER_MODE=process`), and times:

- **start**: the server's command to the model's readiness (every worker loaded);
- **replace**: a worker killed with SIGKILL to a worker of another pid ready in its place and
  every worker ready again (the restart back-off set to 0), `--kills` times a round; and the
  CPU that took, the server's process tree's (user + system) over the same span.

Prints each figure's median with its rounds and writes benchmarks/results/worker_starts-<date>.json
with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks import report
from benchmarks.servers import ServerProcess, free_ports
from scriptserve.archiver.cli import model_archiver_main

# After the packages are imported: the folder tests/archiver would shadow the archiver package.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from testmodels import save_torchscript

KEY = secrets.token_urlsafe(16)


def build_store(root: Path) -> Path:
    store = root / "store"
    sample = root / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", "tiny", "--version", "1.0",
        "--serialized-file", str(save_torchscript(root / "tiny.pt")),
        "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return store


def server(label: str, python: str, store: Path, workers: int) -> ServerProcess:
    port, mgmt, metrics, grpc, grpc_mgmt = free_ports(5)
    argv = [
        python, "-m", "scriptserve", "serve", "--model-store", str(store), "--models", "all",
        "--workers", str(workers), "--intra-op-threads", "1", "--no-snapshot",
        "--inference-address", f"127.0.0.1:{port}",
        "--management-address", f"127.0.0.1:{mgmt}",
        "--metrics-address", f"127.0.0.1:{metrics}",
        "--grpc-inference-address", f"127.0.0.1:{grpc}",
        "--grpc-management-address", f"127.0.0.1:{grpc_mgmt}",
        "--log-level", "warning",
    ]  # fmt: skip
    env = {
        "SCRIPTSERVE_MANAGEMENT_KEY": KEY,
        "SCRIPTSERVE_WORKER_MODE": "process",
        "SCRIPTSERVE_WORKER_RESTART_BACKOFF_S": "0",
        "SCRIPTSERVE_WORKER_MAX_RESTARTS": "1000",
    }
    process = ServerProcess(label, argv, port, "/v2/models/tiny/ready", env)
    process.mgmt_url = f"http://127.0.0.1:{mgmt}"  # type: ignore[attr-defined]
    return process


def ready_pids(process: ServerProcess) -> list[int]:
    """The pids of the model's workers when every one is ready, else []."""
    url = f"{process.mgmt_url}/models/tiny"  # type: ignore[attr-defined]
    answer = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    answer.raise_for_status()
    workers = answer.json()[0]["workers"]
    if all(w["status"] == "READY" and w.get("pid") for w in workers):
        return [int(w["pid"]) for w in workers]
    return []


def tree_cpu(process: ServerProcess) -> dict[int, float]:
    """User + system CPU seconds of the server and each of its descendants, by pid."""
    assert process.proc is not None
    root = psutil.Process(process.proc.pid)
    seconds = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            seconds[p.pid] = sum(p.cpu_times()[:2])
    return seconds


def wait_for(check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the workers did not come back")
        time.sleep(0.005)


def one_round(process: ServerProcess, kills: int) -> dict[str, Any]:
    started = time.perf_counter()
    with process:
        start_s = time.perf_counter() - started
        wait_for(lambda: bool(ready_pids(process)))
        replace_s, replace_cpu_s = [], []
        for _ in range(kills):
            victim = ready_pids(process)[0]
            cpu = tree_cpu(process)
            killed = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda v=victim: (now := ready_pids(process)) != [] and v not in now)
            replace_s.append(time.perf_counter() - killed)
            after = tree_cpu(process)  # the killed worker's CPU was spent before
            replace_cpu_s.append(sum(s - cpu.get(pid, 0.0) for pid, s in after.items()))
    return {"start_s": start_s, "replace_s": replace_s, "replace_cpu_s": replace_cpu_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another tree's python, started the same way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    trees = {"this tree": sys.executable, **({"before": args.before} if args.before else {})}
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    with tempfile.TemporaryDirectory() as tmp:
        store = build_store(Path(tmp))
        for r in range(args.rounds):
            order = list(trees.items())
            for label, python in order[r % len(order) :] + order[: r % len(order)]:
                result = one_round(server(label, python, store, args.workers), args.kills)
                runs[label].append(result)
                print(
                    f"round {r + 1} {label}: start {result['start_s']:.2f} s, replace "
                    + ", ".join(f"{s:.2f}" for s in result["replace_s"])
                    + " s, CPU "
                    + ", ".join(f"{s:.2f}" for s in result["replace_cpu_s"])
                    + " s",
                    flush=True,
                )
    medians: dict[str, dict[str, float]] = {}
    for label, results in runs.items():
        medians[label] = {
            "start_s": statistics.median(x["start_s"] for x in results),
            "replace_s": statistics.median(s for x in results for s in x["replace_s"]),
            "replace_cpu_s": statistics.median(s for x in results for s in x["replace_cpu_s"]),
        }
        figures = ", ".join(f"{k} {v:.2f}" for k, v in medians[label].items())
        print(f"{label} (medians): {figures}")
    host = report.closing({}, load_before)
    report.write_results(
        "worker_starts",
        {"argv": sys.argv[1:], "trees": trees, "medians": medians, "runs": runs, "host": host},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
