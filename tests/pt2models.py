"""Real `.pt2` archives for the tests, compiled by model-archiver once per test session.

- `tiny_archive()`: TinyMLP (8 -> 16 -> 3) from its class and state dict (`--export-pt2`),
  batches of 1 to `TINY_MAX_BATCH` rows;
- `two_heads_archive()`: `TwoHeads`, two inputs and two outputs, whose call at batch
  `SLOW_ROWS` takes about 0.1 s on one core (for the tests of threads running at once);
  compiled by a compiler that links libstdc++ statically by default, as some machines' do
  (`static_cxx_runtime`): its package must link the shared runtime all the same;
- `tiny_package()`: the compiled package inside the tiny archive, as a user would bring it;
- `tiny_int8_archive(mode)`: TinyMLP as an int8 package (`dynamic-int8` or `static-int8`,
  torchao's PT2E flow), with `tiny_validation()` stored in it for the accuracy guard;
- `tiny_bf16_build()`: TinyMLP compiled to compute in bfloat16 (`build_package(...,
  precision="bf16")`, the calls model-archiver makes, which this CPU may refuse), with the
  source it came from.

A compile takes 8 to 25 s. Inductor's cache is build/pt2-test-cache (ignored by git), so a
second session compiles from a warm cache. The conftest's head start (tests/conftest.py)
compiles the archives whose functions the selected test modules import, in one child process at
low priority (`build_in_child`), and those modules' tests run last; without it, the first call
compiles here.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import headstart
import numpy as np
import torch
from testmodels import TinyMLP
from torch import nn

from scriptserve.archiver.cli import model_archiver_main

if TYPE_CHECKING:
    from scriptserve.archiver.pt2_check import Pt2Build
    from scriptserve.archiver.pt2_export import Pt2Source

TESTS = Path(__file__).resolve().parent
INDUCTOR_CACHE = TESTS.parent / "build" / "pt2-test-cache"
TINY_MAX_BATCH = 64
TWO_HEADS_MAX_BATCH = 256
SLOW_ROWS = 256
"""Rows at which a TwoHeads call takes about 0.1 s on one core."""
STATIC_CXX_LINKS = "static-cxx-links.txt"
HEAD_START = "pt2"
WORKDIR_VARIABLE = "SCRIPTSERVE_PT2_TESTS_WORKDIR"


class TwoHeads(nn.Module):
    """a: [B, 256], b: [B, 4] -> (3 outputs of a path through `depth` 1024-wide tanh layers,
    2 outputs of b scaled by a's first column). One layer's weights serve every step, so the
    package stays small while a call at batch SLOW_ROWS does about 9 GFLOP."""

    def __init__(self, depth: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.depth = depth
        self.widen = nn.Linear(256, 1024)
        self.layer = nn.Linear(1024, 1024)
        self.head = nn.Linear(1024, 3)
        self.side = nn.Linear(4, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.widen(a))
        for _ in range(self.depth):
            h = torch.tanh(self.layer(h) / 8)
        return self.head(h), self.side(b) * a[:, :1]


def two_heads_reference(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.inference_mode():
        y, z = TwoHeads().eval()(torch.from_numpy(a), torch.from_numpy(b))
    return y.numpy(), z.numpy()


@contextlib.contextmanager
def inductor_cache() -> Iterator[None]:
    """Compile with the tests' own Inductor cache."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(INDUCTOR_CACHE)
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


_workdir_lock = threading.Lock()


def run_child(script: str, args: Iterable[str], what: str, env: dict[str, str]) -> None:
    """Run `python script args` from the repository root, with tests/ importable and `env`
    added to this process's environment; RuntimeError naming `what`, with the end of the
    child's stderr, when it fails."""
    path = os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1", **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}{done.stdout[-1000:]}"
        )


def workdir() -> Path:
    """A directory for this session's packages and archives, removed at exit: one, whichever
    threads ask first (the head starts ask at once)."""
    with _workdir_lock:
        return _workdir()


@functools.cache
def _workdir() -> Path:
    given = os.environ.get(WORKDIR_VARIABLE)  # the parent's, in the child of build_in_child
    if given:
        return Path(given)
    path = Path(tempfile.mkdtemp(prefix="scriptserve-pt2-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def archive_eager(name: str, model_class: str, sample: object, max_batch: int, *extra: str) -> Path:
    """Export and compile `model_class` (defined in this file or testmodels.py) with its
    state dict through model-archiver; returns the archive."""
    root = workdir() / name
    root.mkdir()
    model = {"TinyMLP": TinyMLP, "TwoHeads": TwoHeads}[model_class]()
    torch.save(model.state_dict(), root / "weights.pt")
    (root / "sample.json").write_text(json.dumps(sample))
    source = TESTS / ("testmodels.py" if model_class == "TinyMLP" else "pt2models.py")
    argv = [
        "--model-name",
        name,
        "--version",
        "1.0",
        "--export-pt2",
        "--model-file",
        str(source),
        "--model-class",
        model_class,
        "--serialized-file",
        str(root / "weights.pt"),
        "--sample-input",
        str(root / "sample.json"),
        "--max-batch",
        str(max_batch),
        "--export-path",
        str(workdir() / "store"),
        *extra,
    ]
    with inductor_cache(), contextlib.redirect_stdout(io.StringIO()):
        assert model_archiver_main(argv) == 0
    return workdir() / "store" / f"{name}.mar"


@contextlib.contextmanager
def static_cxx_runtime() -> Iterator[None]:
    """Compile with Inductor's compiler wrapped as some GPU images' compiler is: a GCC whose
    library path holds libstdc++'s static archive and no `libstdc++.so` (`-lstdc++` finds the
    archive), linking with -static-libstdc++. A model's library then carries a C++ runtime of
    its own, which clashes with torch's (`handlers.runtime.aoti`). Each link it made is
    written to `static_cxx_links()`."""
    from torch._inductor import config
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    archive_only = workdir() / "static-libstdcxx"
    archive_only.mkdir()
    archive = subprocess.run(
        [compiler, "-print-file-name=libstdc++.a"], capture_output=True, text=True, check=True
    )
    (archive_only / "libstdc++.a").symlink_to(archive.stdout.strip())
    links = workdir() / STATIC_CXX_LINKS
    wrapper = workdir() / "static-cxx"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -shared "*)\n'
        f'  echo "$*" >>{shlex.quote(str(links))}\n'
        f'  exec {shlex.quote(compiler)} -L{shlex.quote(str(archive_only))} "$@" '
        "-static-libstdc++ ;;\n"
        "esac\n"
        f'exec {shlex.quote(compiler)} "$@"\n'
    )
    wrapper.chmod(0o755)
    with config.patch({"cpp.cxx": (None, str(wrapper))}):
        yield


def static_cxx_links() -> list[str]:
    """The command lines of the links `static_cxx_runtime` made static."""
    path = workdir() / STATIC_CXX_LINKS
    return path.read_text().splitlines() if path.exists() else []


def _bf16_build() -> Path:
    """TinyMLP's bfloat16 package, built as model-archiver builds it; its Pt2Build and
    Pt2Source pickled beside it."""
    from scriptserve.archiver.pt2_export import Pt2Source, build_package

    root = workdir() / "tiny_bf16"
    root.mkdir()
    torch.save(TinyMLP().state_dict(), root / "weights.pt")
    source = Pt2Source(root / "weights.pt", TESTS / "testmodels.py", "TinyMLP")
    sample = {"x": np.full((1, 8), 0.5, np.float32)}
    with inductor_cache():
        build = build_package(source, sample, TINY_MAX_BATCH, root / "m.pt2", precision="bf16")
    made = _made("tiny_bf16")
    made.write_bytes(pickle.dumps((build, source)))
    return made


def _made(name: str) -> Path:
    """Where the archive `name` is written (the bf16 build: its pickle)."""
    if name == "tiny_bf16":
        return workdir() / name / "build.pickle"
    return workdir() / "store" / f"{name}.mar"


def _make(name: str) -> Path:
    """The archive `name` (see ARCHIVES), compiled in this process."""
    if name == "tiny_bf16":
        return _bf16_build()
    tiny = ("TinyMLP", [0.5] * 8, TINY_MAX_BATCH)
    if name == "tiny_pt2":
        return archive_eager(name, *tiny)
    if name == "two_heads":
        sample = {"a": [0.1] * 256, "b": [0.5, -0.5, 1.0, 2.0]}
        with static_cxx_runtime():
            return archive_eager(name, "TwoHeads", sample, TWO_HEADS_MAX_BATCH)
    mode = name.removeprefix("tiny_").replace("_", "-")  # tiny_dynamic_int8: dynamic-int8
    validation = ("--validation-file", str(tiny_validation()))
    # Measured against the fp32 archive's package, as a user who archived both would: the
    # fp32 model is not compiled again.
    fp32 = ("--fp32-archive", str(tiny_archive()))
    return archive_eager(name, *tiny, "--quantize", mode, *validation, *fp32)


def _archive(name: str) -> Path:
    """The archive `name`: from the head start's child when it made it, else compiled here."""
    made = headstart.result(HEAD_START, dict[str, Path])  # nothing started: an empty dict
    return made[name] if name in made else _make(name)


@functools.cache
def tiny_archive() -> Path:
    return _archive("tiny_pt2")


@functools.cache
def two_heads_archive() -> Path:
    return _archive("two_heads")


@functools.cache
def tiny_package() -> Path:
    """The .pt2 package inside the tiny archive, as a file of its own."""
    target = workdir() / "user" / "tiny.pt2"
    target.parent.mkdir()
    with zipfile.ZipFile(tiny_archive()) as zf:
        target.write_bytes(zf.read("tiny_pt2.pt2"))
    return target


@functools.cache
def tiny_validation() -> Path:
    """TinyMLP validation inputs: normal rows, and rows whose values are all positive (the case
    Inductor's dynamic range computation got wrong; archiver/int8/pt2.py)."""
    path = workdir() / "tiny_validation.npz"
    if path.exists():  # written by the parent of build_in_child's child
        return path
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal((200, 8)), rng.uniform(0.2, 1.0, (56, 8))])
    partial = path.with_suffix(".partial")
    with partial.open("wb") as file:
        np.savez(file, x=x.astype(np.float32))
    partial.replace(path)  # whole or not there, for a reader in another thread
    return path


@functools.cache
def tiny_int8_archive(mode: str) -> Path:
    return _archive("tiny_" + mode.replace("-", "_"))


@functools.cache
def tiny_bf16_build() -> tuple[Pt2Build, Pt2Source]:
    """TinyMLP's bfloat16 package as `build_package` returned it, and its source."""
    made: tuple[Pt2Build, Pt2Source] = pickle.loads(_archive("tiny_bf16").read_bytes())
    return made


ARCHIVES: dict[Callable[..., Path], tuple[str, ...]] = {
    tiny_archive: ("tiny_pt2",),
    tiny_package: ("tiny_pt2",),
    two_heads_archive: ("two_heads",),
    tiny_int8_archive: ("tiny_dynamic_int8", "tiny_static_int8"),
    tiny_bf16_build: ("tiny_bf16",),
}
"""The archives each function gives (tiny_int8_archive: either mode)."""


def archives_used_by(module: object) -> set[str]:
    """The archives a test module needs: those of the functions above that it imported."""
    imported = {id(value) for value in vars(module).values()} if module is not None else set()
    return {name for fn, names in ARCHIVES.items() if id(fn) in imported for name in names}


def build_in_child(names: Iterable[str]) -> dict[str, Path]:
    """Compile the archives `names` in one child process (`python tests/pt2models.py`), into
    this session's workdir: torch and Inductor load once for all of them."""
    names = sorted(names)
    tiny_validation()  # written here, before the child reads it
    run_child(
        __file__, names, "compiling the .pt2 test archives", {WORKDIR_VARIABLE: str(workdir())}
    )
    return {name: _made(name) for name in names}


if __name__ == "__main__":
    for archive in sys.argv[1:]:
        if not _made(archive).exists():  # the fp32 archive an int8 one was measured against
            _make(archive)
