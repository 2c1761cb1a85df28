"""The scriptserve replicas behind haproxy: one on fixed ports, and its SIGTERM and restart."""

from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.rollout.haproxy import READY_PATH, Balancer
from benchmarks.rollout.load import CountingLoad
from benchmarks.servers import ServerProcess, free_port


class Replica:
    """One scriptserve replica on fixed loopback ports, which it keeps across restarts."""

    def __init__(self, name: str, store: Path, server_args: tuple[str, ...] = ()) -> None:
        self.name = name
        self.port, self._mgmt, self._metrics, self._grpc, self._grpc_mgmt = (
            free_port() for _ in range(5)
        )
        self.argv = [
            sys.executable, "-m", "scriptserve", "serve", "--model-store", str(store),
            "--models", "all", "--device", "cpu",
            # Replicas share the store: the declarative mode records no snapshot there.
            "--snapshot-mode", "declarative",
            "--inference-address", f"127.0.0.1:{self.port}",
            "--management-address", f"127.0.0.1:{self._mgmt}",
            "--metrics-address", f"127.0.0.1:{self._metrics}",
            "--grpc-inference-address", f"127.0.0.1:{self._grpc}",
            "--grpc-management-address", f"127.0.0.1:{self._grpc_mgmt}",
            "--workers", "1", "--intra-op-threads", "1",
            "--max-batch-size", "32", "--max-batch-delay", "0", "--log-level", "warning",
            *server_args,
        ]  # fmt: skip
        self.process: ServerProcess | None = None

    def start(self) -> None:
        """Start the server and wait until it answers ready."""
        # The server sets torch's threads on the thread that loads the model; the worker thread
        # that runs it keeps OpenMP's default (the count is per thread: one per core), so MKL's
        # sgemm runs a team of two whose spin-waits collapse two replicas sharing two cores
        # (measured: 1,160 req/s together, 6,300 with this). This sets every thread's default.
        env = {"OMP_NUM_THREADS": "1"}
        process = ServerProcess(self.name, self.argv, self.port, READY_PATH, env)
        process.metrics_url = f"http://127.0.0.1:{self._metrics}/metrics"
        self.process = process.__enter__()

    def answered(self) -> int:
        """Inference requests this process has answered 200 (its own metrics)."""
        assert self.process is not None
        counts = self.process.request_counts()
        return sum(n for (_, status), n in counts.items() if status == "200")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass
class Restart:
    """One replica's SIGTERM and restart; times in seconds since the load started."""

    replica: str
    sigterm_s: float
    answered_before: int
    """Requests the old process had answered 200 when it got SIGTERM."""
    marked_down_s: float = math.nan
    exited_s: float = math.nan
    exit_code: int | None = None
    ready_s: float = math.nan
    up_s: float = math.nan
    """When haproxy had it UP again."""
    answered_after: int = 0
    """Requests the new process answered 200 by the end of the next steady phase."""


def restart(replica: Replica, balancer: Balancer, load: CountingLoad) -> Restart:
    """SIGTERM `replica`, wait for it to exit (haproxy marks it DOWN meanwhile), start it
    again on the same ports and wait until haproxy has it UP."""
    process = replica.process
    assert process is not None and process.proc is not None
    event = Restart(replica.name, load.now(), replica.answered())
    process.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60.0
    while math.isnan(event.marked_down_s) or event.exit_code is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{replica.name}: not DOWN and exited within 60 s of SIGTERM")
        if math.isnan(event.marked_down_s) and balancer.status(replica.name) == "DOWN":
            event.marked_down_s = load.now()
        if event.exit_code is None and process.proc.poll() is not None:
            event.exited_s, event.exit_code = load.now(), process.proc.returncode
        time.sleep(0.05)
    if event.exit_code != 0:
        raise RuntimeError(f"{replica.name} exited {event.exit_code}:\n{process.output()}")
    process.stop()  # it has exited: this closes its log
    replica.start()
    event.ready_s = load.now()
    balancer.wait_for(replica.name, "UP", timeout_s=30.0)
    event.up_s = load.now()
    return event
