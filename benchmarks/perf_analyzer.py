"""perf_analyzer, Triton's load tool, against scriptserve: scenario A's MLP over HTTP (binary
tensor data) and gRPC, with the server-side breakdown from the statistics extension.

    python -m benchmarks.perf_analyzer                      # concurrency 1 and 8: about 1 minute
    python -m benchmarks.perf_analyzer --concurrency 1:4:1  # any --concurrency-range

perf_analyzer comes with the tritonclient wheel (version in constraints.txt); it needs Debian's
libb64-0d and libcudart from the nvidia-cuda-runtime-cu12 wheel (found here), no GPU. The model is
archived at version "1": perf_analyzer looks server statistics up under an integer version, as
Triton's versions are.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.models import build
from benchmarks.servers import scriptserve


def perf_analyzer_env() -> dict[str, str]:
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime
    except ImportError:
        return env
    libs = [str(Path(p) / "lib") for p in nvidia.cuda_runtime.__path__]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")])
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1:8:7", help="perf_analyzer's range (1 and 8)")
    parser.add_argument("--window-ms", type=int, default=3000, help="measurement window")
    args = parser.parse_args()
    binary = shutil.which("perf_analyzer") or str(Path(sys.executable).parent / "perf_analyzer")
    env = perf_analyzer_env()
    with tempfile.TemporaryDirectory() as tmp:
        model = build("mlp", Path(tmp) / "work", Path(tmp) / "store", version="1")
        server = scriptserve(
            "scriptserve",
            Path(tmp) / "store",
            "mlp",
            workers=2,
            intra_op_threads=1,
            max_batch_size=32,
        )
        with server:
            assert server.grpc_address is not None
            for protocol, url in (
                ("http", server.url.removeprefix("http://")),
                ("grpc", server.grpc_address),
            ):
                cmd = [
                    binary, "-m", model.name, "-i", protocol, "-u", url,
                    "--concurrency-range", args.concurrency,
                    "--measurement-interval", str(args.window_ms),
                    "--stability-percentage", "50", "--max-trials", "8",
                ]  # fmt: skip
                if protocol == "http":
                    cmd += ["--input-tensor-format", "binary", "--output-tensor-format", "binary"]
                print(f"$ perf_analyzer {' '.join(cmd[1:])}", flush=True)
                done = subprocess.run(cmd, check=False, env=env, timeout=600)
                if done.returncode != 0:
                    print(f"perf_analyzer exited {done.returncode}")
                    return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
