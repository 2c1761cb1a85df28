"""Where a `.pt2` package loads: the same package, made by this machine's torch, loaded and run
in fresh processes that each set up something else first (`make gpu-check`'s `loads` step).

The first GPU runs showed a package that loads in a process that has done other work with torch
(the check itself, pytest) crash while its container is made in a fresh one (model-archiver's
check, the server, a child compiling the tests' CPU packages). Each variant here is one fresh
process: what it set up, how it ended, what it printed, and, where it crashed, the native frames
(a SIGSEGV handler preloaded into it prints them); beside them, how `ldd` resolves the model's
libraries and which libraries a fresh process initialised (`LD_DEBUG=libs`). One run on the GPU
machine then says which set-up a container needs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CHILD = r"""
import sys
from pathlib import Path

so, device, kernels, setup, features = sys.argv[1:6]
if setup == "onnxruntime":
    import onnxruntime  # noqa: F401
import torch

if setup == "cuda_init":
    torch.cuda.init()
elif setup == "cuda_tensor":
    torch.zeros(1, device=device).sum().item()
elif setup == "torchscript":
    torch.jit.script(torch.nn.Linear(2, 2))(torch.ones(1, 2))
elif setup == "inductor":
    import torch._inductor.config  # noqa: F401
from scriptserve.handlers.runtime.aoti import AotiLibrary

library = AotiLibrary(Path(so))
print("loaded", flush=True)
container = library.create(1, device, Path(kernels) if kernels != "-" else None)
print("created", flush=True)
outputs = library.run(container, [torch.zeros(2, int(features), device=device)], 1)
print("ran", tuple(outputs[0].shape), flush=True)
library.delete(container)
"""

SEGV_HANDLER = r"""
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig) {
    void* frames[64];
    int n = backtrace(frames, 64);
    static const char head[] = "native frames at the signal:\n";
    write(2, head, sizeof head - 1);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigaction(SIGSEGV, &action, 0);
    sigaction(SIGBUS, &action, 0);
    sigaction(SIGABRT, &action, 0);
}
"""

SETUPS = ("plain", "cuda_init", "cuda_tensor", "onnxruntime", "torchscript", "inductor")
"""What a fresh process does before it loads the package; the CUDA ones only for a CUDA one."""


def segv_handler(workdir: Path) -> Path | None:
    """The SIGSEGV handler, compiled here with the C compiler AOTInductor uses; None without one."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, library = workdir / "segv.c", workdir / "segv.so"
    source.write_text(SEGV_HANDLER)
    done = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    return library if done.returncode == 0 else None


def load_in_fresh_processes(
    so: Path,
    device: str,
    kernels: Path | None,
    features: int,
    workdir: Path,
    setups: tuple[str, ...] = SETUPS,
) -> dict[str, Any]:
    """One fresh process per set-up (the CUDA ones only on a GPU; with every set-up, one more
    with the libraries bound at load), and one with the native frames of a crash: each one's
    end, the steps it reached and, where it failed, the last of what it printed."""
    handler = segv_handler(workdir)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    runs: list[tuple[str, dict[str, str]]] = [
        (s, env) for s in setups if device.startswith("cuda") or not s.startswith("cuda")
    ]
    loader_log = workdir / "ld-debug"
    if setups == SETUPS:
        runs.append(("plain+bind_now", {**env, "LD_BIND_NOW": "1"}))
        # The dynamic loader's own account: every library the process initialised, in order
        # (a second OpenMP or C++ runtime, a library from an unexpected place).
        libraries = {**env, "LD_DEBUG": "libs", "LD_DEBUG_OUTPUT": str(loader_log)}
        runs.append(("plain+libraries", libraries))
    if handler is not None:
        native = {k: v for k, v in env.items() if k != "PYTHONFAULTHANDLER"}
        runs.append(("plain+native_frames", {**native, "LD_PRELOAD": str(handler)}))
    found: dict[str, Any] = {"native_frames": handler is not None, "ldd": _ldd(so)}
    for name, run_env in runs:
        setup = name.partition("+")[0]
        argv = [sys.executable, "-c", CHILD, str(so), device, str(kernels or "-"), setup]
        try:
            done = subprocess.run(
                [*argv, str(features)],
                env=run_env,
                capture_output=True,
                text=True,
                timeout=180,
                check=False,
            )
        except subprocess.TimeoutExpired:
            found[name] = {"exit": "timed out after 180 s"}
            continue
        reached = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
        record: dict[str, Any] = {"exit": done.returncode, "reached": reached}
        if done.returncode != 0:
            head, marker, frames = done.stderr.partition("native frames at the signal:")
            record["stderr"] = head[-2500:]
            if marker:  # the innermost frames first, where the crash is
                record["native_frames"] = frames.strip().splitlines()[:30]
        if name == "plain+libraries":
            record["initialised"] = _initialised(loader_log)
        found[name] = record
    return found


def _ldd(so: Path) -> list[str]:
    """How the dynamic loader resolves the compiled model's libraries, outside any process."""
    if shutil.which("ldd") is None:
        return ["ldd is not installed"]
    done = subprocess.run(["ldd", str(so)], capture_output=True, text=True, check=False)
    return [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]


def _initialised(log: Path) -> list[str]:
    """The libraries LD_DEBUG=libs says the process initialised, in order (its file is named
    after the process id)."""
    found: list[str] = []
    for path in sorted(log.parent.glob(f"{log.name}.*")):
        for line in path.read_text(errors="replace").splitlines():
            _, marker, library = line.partition("calling init: ")
            if marker:
                found.append(library.strip())
    return found


def extracted(archive: Path, dest: Path) -> tuple[Path, str]:
    """The compiled model's library from `archive`, extracted into `dest`, and the device its
    package was compiled for."""
    from scriptserve.archiver.archive import open_archive
    from scriptserve.archiver.pt2_package import read_package

    with open_archive(archive) as reader:
        name = reader.manifest.model.serialized_file
        assert name is not None
        package = read_package(reader.root / name)
        return package.extract(dest), package.device


def probe(archives: list[tuple[Path, int]], setups: tuple[str, ...] = SETUPS) -> dict[str, Any]:
    """For each (archive, input width): its package loaded in fresh processes."""
    found: dict[str, Any] = {}
    for archive, features in archives:
        with tempfile.TemporaryDirectory(prefix="scriptserve-loads-") as tmp:
            so, kind = extracted(archive, Path(tmp))
            device = "cuda:0" if kind == "cuda" else "cpu"
            kernels = Path(tmp) if kind == "cuda" else None
            found[archive.stem] = {
                "device": device,
                **load_in_fresh_processes(so, device, kernels, features, Path(tmp), setups),
            }
    return found


def crashed(found: dict[str, Any]) -> list[str]:
    """The runs of `probe`'s answer that did not end well, as 'archive/set-up'."""
    return [
        f"{archive}/{name}"
        for archive, runs in found.items()
        for name, run in runs.items()
        if isinstance(run, dict) and run.get("exit") != 0
    ]
