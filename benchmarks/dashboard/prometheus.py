"""Debian's Prometheus on loopback, scraping the server under load every second, and its HTTP
API's queries as Grafana would send them."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from benchmarks.servers import free_port

JOB = "scriptserve"
SCRAPE_S = 1
STEP_S = 2
# Grafana's $__rate_interval: max(4 x scrape interval, query step + scrape interval).
RATE_INTERVAL = f"{max(4 * SCRAPE_S, STEP_S + SCRAPE_S)}s"


class QueryError(Exception):
    """Prometheus refused a query (its message)."""


class Prometheus:
    """Debian's prometheus in `workdir`, scraping `target` (host:port) every second under the job
    `JOB`, on a free loopback port; a context manager that returns once the target is scraped."""

    def __init__(self, binary: str, workdir: Path, target: str) -> None:
        self.argv = [
            binary, f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}", "--log.level=warn",
        ]  # fmt: skip
        self.workdir = workdir
        self.target = target
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.queries = 0
        self._client = httpx.Client(timeout=10)

    def __enter__(self) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        scrape = {
            "job_name": JOB,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [self.target]}],
        }
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s"}, "scrape_configs": [scrape]}
        # JSON is YAML, so no YAML writer is needed.
        (self.workdir / "prometheus.yml").write_text(json.dumps(config, indent=1))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [*self.argv, f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        try:
            self._wait(lambda: self._client.get(f"{self.url}/-/ready").status_code == 200, 60)
            self._wait(lambda: bool(self.query(f'up{{job="{JOB}"}} == 1', time.time())), 30)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                if done():
                    return
            except (httpx.TransportError, QueryError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready within {timeout_s:g} s:\n{self.log()}")

    def wait_for_scrape_after(self, at: float) -> None:
        """Return once a scrape taken after `at` is stored: queries at `at` then see it all."""
        expr = f'max(timestamp(up{{job="{JOB}"}}))'
        self._wait(
            lambda: any(float(r["value"][1]) >= at for r in self.query(expr, time.time())),
            10 * SCRAPE_S,
        )

    def _api(self, path: str, params: Mapping[str, str | float]) -> Any:
        self.queries += 1
        answer = self._client.get(f"{self.url}/api/v1/{path}", params=dict(params)).json()
        if answer.get("status") != "success":
            raise QueryError(str(answer.get("error", answer)))
        return answer["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        data = self._api("query", {"query": expr, "time": at})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(
        self, expr: str, start: float, end: float, step: float = STEP_S
    ) -> list[dict[str, Any]]:
        data = self._api("query_range", {"query": expr, "start": start, "end": end, "step": step})
        return list(data["result"])

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        self._client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(path).exists():
        raise SystemExit("prometheus is not installed: apt-get install -y prometheus")
    return path
