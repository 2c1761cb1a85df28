"""Real models made by the tests: small TorchScript and ONNX files, and archives of them."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import headstart
import pt2models
import pytest
from testmodels import TinyMLP, reference_output, save_onnx, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

if TYPE_CHECKING:
    from zoo_archives import ZooStore

__all__ = ["TinyMLP", "reference_output", "save_onnx", "save_torchscript"]


@pytest.fixture
def torchscript_file(tmp_path: Path) -> Path:
    return save_torchscript(tmp_path / "tiny.pt")


@pytest.fixture
def onnx_file(tmp_path: Path) -> Path:
    return save_onnx(tmp_path / "tiny.onnx")


@pytest.fixture
def sample_file(tmp_path: Path) -> Path:
    path = tmp_path / "sample.json"
    path.write_text(json.dumps([0.5] * 8))
    return path


ArchiveFactory = Callable[..., Path]


@pytest.fixture
def make_archive(tmp_path: Path, sample_file: Path) -> ArchiveFactory:
    """Build an archive with model-archiver's own entry point; returns its path."""

    def make(
        model: Path,
        name: str = "tiny",
        fmt: str = "default",
        handler: str = "tensor",
        extra: list[str] | None = None,
        export: Path | None = None,
    ) -> Path:
        export = export or tmp_path / "store"
        argv = [
            "--model-name",
            name,
            "--version",
            "1.0",
            "--serialized-file",
            str(model),
            "--handler",
            handler,
            "--sample-input",
            str(sample_file),
            "--export-path",
            str(export),
            "--archive-format",
            fmt,
            "-f",
            *(extra or []),
        ]
        assert model_archiver_main(argv) == 0
        suffix = {"default": ".mar", "zip-store": ".mar", "tgz": ".tar.gz", "no-archive": ""}[fmt]
        return export / f"{name}{suffix}"

    return make


# Fixtures whose making takes half a minute to minutes of child processes: what starts them in
# the background (headstart.py) once collection shows they will be used. The `.pt2` archives of
# pt2models.py get one too (`pt2models.HEAD_START`), for the test modules that import the
# functions that give them. Listed in the order they end in a whole run on 2 cores (the run's
# summary prints when each ended), which is the order their tests run in: a test waits only
# for what is still being made.
HEAD_STARTS = (
    "gpu_wheels",
    "fsdp_runs",
    "gpu_dry_run",
    "installed",
    "qat_run",
    "trained",
    "built_image",
    pt2models.HEAD_START,
    "zoo",
)
GPU_CHECK = {"gpu_dry_run": "--dry-run", "gpu_wheels": "--prepare"}
"""The gpu check's runs that tests/packaging/test_gpu_check.py reads, by fixture."""


COMPILE_FLAGS = {
    "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL": "O0",
    "AOT_INDUCTOR_ENABLE_LINE_TABLES": "0",
}
"""How the tests' `.pt2` packages are compiled, here and in every child: AOTInductor's wrapper
(the calls from one kernel to the next, at -O1 by default) at -O0 and no line tables for
profilers. It makes the same calls; the kernels keep -O3. A wrapper took about a quarter less of
the compiler's time (14.3 s of CPU against 10.6 s for the zoo's small ResNet-50, on a 2-core AMD
EPYC), and the suite compiles some thirty."""


def pytest_configure(config: pytest.Config) -> None:
    for name, value in COMPILE_FLAGS.items():
        os.environ.setdefault(name, value)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so that the `slow` marks added count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use a fixture with a head start are `slow`, marked so or not (`make check`
    never waits for one), and run last, so that it has the whole run to be made while the other
    tests go on, in the order the head starts end (`HEAD_STARTS`; stable otherwise). Tests
    marked `gpu` need CUDA; they are skipped (with the reason) where there is none."""
    for item in items:
        if _uses_head_start(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_head_start_turn)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the head starts that the selected tests (what `-m` and `-k` left) will use; none
    for `--collect-only`, where no test runs and a child started here would outlive pytest."""
    if session.config.option.collectonly:
        return
    used = {name for item in session.items for name in _fixtures(item)}
    if "built_image" in used:
        from tests.docker.buildah import build_default_image, unbuildable_reason

        if unbuildable_reason() is None:
            headstart.start("image", build_default_image, headstart.SERIAL_NICENESS)
    if "installed" in used:
        import distribution

        headstart.start("installed", distribution.gpu_layer)
    if "zoo" in used:
        import zoo_archives

        headstart.start("zoo", zoo_archives.build_zoo)
    for fixture, option in GPU_CHECK.items():
        if fixture in used:
            import distribution

            headstart.start(fixture, functools.partial(distribution.gpu_check, option))
    if "fsdp_runs" in used:
        headstart.start("fsdp_runs", _fsdp_runs)
    for fixture, run in (("trained", "digits"), ("qat_run", "qat")):
        if fixture in used:
            import trainruns

            headstart.start(fixture, functools.partial(trainruns.run_in_child, run))
    archives = set().union(*map(_pt2_archives, session.items))
    if archives:
        build = functools.partial(pt2models.build_in_child, archives)
        headstart.start(pt2models.HEAD_START, build, headstart.SERIAL_NICENESS)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How long each head start took, and how long the tests waited for it."""
    lines = headstart.summary()
    if lines:
        terminalreporter.write_sep("-", "head starts")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def installed() -> Iterator[tuple[Path, str]]:
    """The wheel installed as the GPU image installs it (distribution.gpu_layer): the fresh
    environment's bin/ folder and what docker/gpu-layer.sh printed. Deleted at the end."""
    import distribution

    made = headstart.result("installed", distribution.gpu_layer)
    yield made
    shutil.rmtree(made[0].parents[1], ignore_errors=True)


@pytest.fixture(scope="session")
def gpu_dry_run() -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    """`benchmarks.gpu_check --dry-run`'s run and its results file (distribution.gpu_check)."""
    yield from _gpu_check("gpu_dry_run")


@pytest.fixture(scope="session")
def gpu_wheels() -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    """`benchmarks.gpu_check --prepare`'s run and the folder of wheels it prepared."""
    yield from _gpu_check("gpu_wheels")


def _gpu_check(fixture: str) -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    import distribution

    made = headstart.result(fixture, functools.partial(distribution.gpu_check, GPU_CHECK[fixture]))
    yield made
    shutil.rmtree(made[1].parent, ignore_errors=True)


def _fsdp_runs() -> tuple[Path, dict[str, Any]]:
    import fsdpruns

    root = Path(tempfile.mkdtemp(prefix="scriptserve-fsdp-"))
    return root, fsdpruns.strategy_runs(root)


@pytest.fixture(scope="session")
def fsdp_runs() -> Iterator[dict[str, Any]]:
    """The same seeded training one process, DDP and FSDP on two ranks (tests/fsdpruns.py)."""
    root, runs = headstart.result("fsdp_runs", _fsdp_runs)
    yield runs
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def zoo() -> ZooStore:
    """The zoo's small models and their archives (tests/zoo_archives.py)."""
    import zoo_archives

    return headstart.result("zoo", zoo_archives.build_zoo)


def _fixtures(item: pytest.Item) -> list[str]:
    return list(getattr(item, "fixturenames", ()))


def _pt2_archives(item: pytest.Item) -> set[str]:
    return pt2models.archives_used_by(getattr(item, "module", None))


def _uses_head_start(item: pytest.Item) -> bool:
    return _head_start_turn(item) > 0


def _head_start_turn(item: pytest.Item) -> int:
    """0 for a test that uses no head start, else 1 + the place in `HEAD_STARTS` of the last
    to end of those it uses."""
    used = set(_fixtures(item))
    if _pt2_archives(item):
        used.add(pt2models.HEAD_START)
    return max((i + 1 for i, name in enumerate(HEAD_STARTS) if name in used), default=0)
