"""wrk as the load generator: closed-loop HTTP load, requests/s and latency percentiles.

wrk's Lua `done` hook prints one JSON line with exact figures (requests, duration, errors and
the 50/90/99th latency percentiles in microseconds), which is what gets parsed; `--latency`
keeps wrk's own human-readable distribution in the raw output for anyone reading it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

_REPORT = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, '
    .. '"status": %d, "timeout": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


def _post_script(body: Path) -> str:
    return (
        f"local f = assert(io.open({json.dumps(str(body))}, 'rb'))\n"
        "wrk.method = 'POST'\n"
        "wrk.body = f:read('*a')\n"
        "f:close()\n"
        "wrk.headers['Content-Type'] = 'application/json'\n" + _REPORT
    )


@dataclass(frozen=True)
class LoadResult:
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    requests: int
    errors: int
    """Socket errors plus non-2xx/3xx answers; a run with errors is not comparable."""
    wrk_cpu: float
    """wrk's CPU time over the run's wall time (1.0 = one core busy)."""

    def to_dict(self) -> dict[str, float | int]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("wrk is not installed: apt-get install -y wrk")
    return path


def run_wrk(
    url: str, connections: int, seconds: float, threads: int, body: Path | None = None
) -> LoadResult:
    """Load `url` for `seconds` (POST `body` as JSON, or GET when None) and summarise the run."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "load.lua"
        script.write_text(_post_script(body) if body is not None else _REPORT)
        out = Path(tmp) / "wrk.out"
        argv = [
            wrk_path(), f"-t{min(threads, connections)}", f"-c{connections}",
            f"-d{max(1, round(seconds))}s", "--timeout", "10s", "--latency",
            "-s", str(script), url,
        ]  # fmt: skip
        with out.open("wb") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        text = out.read_text(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith("WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {' '.join(argv)}\n{text}")
    r = json.loads(line.removeprefix("WRK_JSON "))
    duration_s = r["duration_us"] / 1e6
    errors = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
    return LoadResult(
        rps=r["requests"] / duration_s,
        p50_ms=r["p50_us"] / 1000,
        p90_ms=r["p90_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        requests=r["requests"],
        errors=errors,
        wrk_cpu=(usage.ru_utime + usage.ru_stime) / duration_s,
    )


@dataclass(frozen=True)
class Run:
    """One measured run: wrk's figures and what the server did meanwhile."""

    load: LoadResult
    server_cpu: float
    """The server's CPU time over the run's wall time (2.0 = two cores busy)."""
    mean_batch: float | None
    """Requests per model call (scriptserve only, from its batch-size histogram)."""

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            **self.load.to_dict(),
            "server_cpu": round(self.server_cpu, 3),
            "mean_batch": None if self.mean_batch is None else round(self.mean_batch, 2),
        }
