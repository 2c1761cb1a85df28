"""The .pt2 backend on real AOTInductor packages: outputs against eager, the batch bound, several
inputs and outputs, threads running at once, and the packages it refuses at load."""

from __future__ import annotations

import dataclasses
import gc
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from pt2models import (
    SLOW_ROWS,
    TINY_MAX_BATCH,
    TWO_HEADS_MAX_BATCH,
    archive_eager,
    static_cxx_links,
    tiny_archive,
    two_heads_archive,
    two_heads_reference,
)
from testmodels import reference_output

from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.manifest import Manifest, Pt2Info
from scriptserve.archiver.pt2_package import read_package
from scriptserve.handlers.backends import BackendError, load_backend
from scriptserve.handlers.backends.pt2 import Pt2Backend
from scriptserve.handlers.runtime.aoti import AotiError, AotiLibrary

# Slow: the tiny and two-input models compiled to .pt2.
pytestmark = pytest.mark.slow

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@dataclasses.dataclass(frozen=True)
class Opened:
    package: Path
    manifest: Manifest

    def backend(
        self,
        device: str = "cpu",
        workers: int = 1,
        *,
        options: dict[str, object] | None = None,
        torch_version: str | None = None,
        target_device: str | None = None,
        cpu_flags: tuple[str, ...] | None = None,
    ) -> Pt2Backend:
        """The backend, on this manifest or one whose recorded build is edited."""
        manifest = self.manifest
        assert manifest.scriptserve is not None and manifest.scriptserve.pt2 is not None
        info = manifest.scriptserve.pt2
        target = dataclasses.replace(
            info.target,
            device=target_device or info.target.device,
            cpu_flags=info.target.cpu_flags if cpu_flags is None else cpu_flags,
        )
        edited = dataclasses.replace(
            info, torch_version=torch_version or info.torch_version, target=target
        )
        manifest = manifest.with_scriptserve(dataclasses.replace(manifest.scriptserve, pt2=edited))
        backend = load_backend(
            self.package, "pt2", device=device, options=options, manifest=manifest, workers=workers
        )
        assert isinstance(backend, Pt2Backend)
        return backend

    @property
    def info(self) -> Pt2Info:
        assert self.manifest.scriptserve is not None and self.manifest.scriptserve.pt2 is not None
        return self.manifest.scriptserve.pt2


def opened(archive: Path) -> Iterator[Opened]:
    with open_archive(archive) as reader:
        name = reader.manifest.model.serialized_file
        assert name is not None
        yield Opened(reader.root / name, reader.manifest)


@pytest.fixture(scope="module")
def tiny() -> Iterator[Opened]:
    yield from opened(tiny_archive())


@pytest.fixture(scope="module")
def two_heads() -> Iterator[Opened]:
    yield from opened(two_heads_archive())


def rows(n: int, width: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


# -- running --------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 7, TINY_MAX_BATCH])
def test_outputs_match_eager_from_one_row_to_the_exported_max(tiny: Opened, batch: int) -> None:
    backend = tiny.backend()
    x = rows(batch, seed=batch)

    outputs = backend.run({"x": x})

    assert backend.input_names == ("x",)
    assert backend.output_names == ("output0",)
    assert backend.max_batch == TINY_MAX_BATCH
    assert outputs["output0"].shape == (batch, 3)
    assert outputs["output0"].dtype == np.float32
    np.testing.assert_allclose(outputs["output0"], reference_output(x), atol=1e-4, rtol=0)


def test_the_single_threaded_run_answers_as_the_shared_run(tiny: Opened, tmp_path: Path) -> None:
    """The run CUDA graphs are captured with (pt2.py `_capture_call`) is the package's own
    single-threaded entry point: bound through the C ABI, it answers as the pooled run does."""
    library = AotiLibrary(read_package(tiny.package).extract(tmp_path))
    container = library.create(1, "cpu")
    try:
        assert library.runs_single_threaded
        x = torch.from_numpy(rows(5, seed=8))
        shared = library.run(container, [x], 1)
        alone = library.run(container, [x], 1, single_threaded=True)
    finally:
        library.delete(container)
        library.close()

    torch.testing.assert_close(alone[0], shared[0], atol=0, rtol=0)
    np.testing.assert_allclose(alone[0].numpy(), reference_output(x.numpy()), atol=1e-4, rtol=0)


def test_outputs_own_their_memory_past_later_calls_and_the_backend_itself(tiny: Opened) -> None:
    backend = tiny.backend()
    x = rows(5, seed=3)
    first = backend.run({"x": x})["output0"]
    expected = reference_output(x)

    for seed in range(20):
        backend.run({"x": rows(TINY_MAX_BATCH, seed=seed)})
    backend.close()
    del backend
    gc.collect()

    np.testing.assert_allclose(first, expected, atol=1e-4, rtol=0)


def test_a_batch_over_the_exported_max_is_refused_before_the_model_runs(tiny: Opened) -> None:
    backend = tiny.backend()

    with pytest.raises(BackendError) as info:
        backend.run({"x": rows(TINY_MAX_BATCH + 1)})

    assert str(info.value) == (
        f"a batch of {TINY_MAX_BATCH + 1} rows is more than the {TINY_MAX_BATCH} the .pt2 model "
        f"was exported for; send at most {TINY_MAX_BATCH} rows at once, or rebuild the archive "
        "with a larger --max-batch"
    )


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (
            np.ones((2, 5), np.float32),
            "input 'x' has shape [2, 5]; the model takes [-1, 8] (-1 = any size)",
        ),
        (np.ones((2, 8), np.float64), "input 'x' has datatype FP64; the model takes FP32"),
        (
            np.ones((2, 2, 4), np.float32),
            "input 'x' has shape [2, 2, 4]; the model takes [-1, 8] (-1 = any size)",
        ),
    ],
)
def test_inputs_that_do_not_fit_the_signature_never_reach_the_compiled_code(
    tiny: Opened, x: np.ndarray, message: str
) -> None:
    with pytest.raises(BackendError, match=f"^{re.escape(message)}$"):
        tiny.backend().run({"x": x})


def test_two_inputs_and_two_outputs_in_the_packages_order(two_heads: Opened) -> None:
    backend = two_heads.backend()
    a, b = rows(5, 256, seed=1), rows(5, 4, seed=2)

    outputs = backend.run({"b": b, "a": a})

    assert backend.input_names == ("a", "b")
    assert list(outputs) == ["output0", "output1"]
    y, z = two_heads_reference(a, b)
    np.testing.assert_allclose(outputs["output0"], y, atol=1e-4, rtol=0)
    np.testing.assert_allclose(outputs["output1"], z, atol=1e-4, rtol=0)
    with pytest.raises(BackendError, match=r"^missing model input\(s\): b$"):
        backend.run({"a": a})
    with pytest.raises(BackendError, match="same number of rows"):
        backend.run({"a": a, "b": b[:3]})


@dataclasses.dataclass
class Calls:
    """What `calls_at_once` saw: each thread's (start, end) per call, and how often, of the
    moments every thread was inside a call, every thread was runnable (state R)."""

    spans: list[list[tuple[float, float]]]
    all_runnable: int = 0
    all_inside: int = 0


def thread_state(tid: int) -> str:
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def calls_at_once(backend: Pt2Backend, threads: int, calls: int) -> Calls:
    """`threads` threads calling the slow model `calls` times each, started together. While
    they run, this thread looks at their scheduler states: a thread blocked on the GIL or
    waiting for a free model instance sleeps (S); threads running model code are R, even when
    another process holds a core."""
    a, b = rows(SLOW_ROWS, 256), rows(SLOW_ROWS, 4)
    seen = Calls([[] for _ in range(threads)])
    tids = [0] * threads
    inside = [False] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def work(slot: int) -> None:
        tids[slot] = threading.get_native_id()
        try:
            start.wait()
            for _ in range(calls):
                began = time.perf_counter()
                inside[slot] = True
                backend.run({"a": a, "b": b})
                inside[slot] = False
                seen.spans[slot].append((began, time.perf_counter()))
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            inside[slot] = False

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    while any(t.is_alive() for t in pool):
        if all(inside):
            try:
                states = [thread_state(tid) for tid in tids]
            except (FileNotFoundError, ProcessLookupError):
                # A thread ended its last call and exited between the check and the read: gone
                # before the open (ENOENT) or between the open and the read (ESRCH).
                continue
            if all(inside):
                seen.all_inside += 1
                seen.all_runnable += all(state == "R" for state in states)
        time.sleep(0.001)
    for t in pool:
        t.join()
    assert errors == []
    return seen


needs_proc = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="reads thread states from /proc"
)


@needs_proc
def test_two_threads_run_the_model_at_the_same_time(two_heads: Opened) -> None:
    backend = two_heads.backend(workers=2)
    assert backend.models == 2

    seen = calls_at_once(backend, threads=2, calls=3)

    # The threads' calls overlap in time for most of their length...
    (a_start, a_end), (b_start, b_end) = [(s[0][0], s[-1][1]) for s in seen.spans]
    overlap = min(a_end, b_end) - max(a_start, b_start)
    assert overlap > 0.5 * min(a_end - a_start, b_end - b_start), seen.spans
    # ...and both threads were in model code together, not taking turns: a thread waiting for
    # the GIL or for a free model instance sleeps.
    assert seen.all_inside >= 20, seen
    assert seen.all_runnable >= 0.8 * seen.all_inside, seen


@needs_proc
def test_the_container_grows_when_more_threads_call_than_it_has_models(
    two_heads: Opened,
) -> None:
    backend = two_heads.backend(workers=1)
    assert backend.models == 1

    calls_at_once(backend, threads=2, calls=1)
    seen = calls_at_once(backend, threads=2, calls=2)

    assert backend.models == 2
    assert seen.all_runnable >= 0.8 * seen.all_inside, seen
    a, b = rows(3, 256, seed=5), rows(3, 4, seed=6)
    np.testing.assert_allclose(
        backend.run({"a": a, "b": b})["output0"], two_heads_reference(a, b)[0], atol=1e-4
    )


def test_the_maximum_batch_runs_on_the_two_input_model(two_heads: Opened) -> None:
    a, b = rows(TWO_HEADS_MAX_BATCH, 256, seed=7), rows(TWO_HEADS_MAX_BATCH, 4, seed=8)

    outputs = two_heads.backend().run({"a": a, "b": b})

    np.testing.assert_allclose(outputs["output1"], two_heads_reference(a, b)[1], atol=1e-4)


# -- the C++ runtime a package links --------------------------------------------------------
def needed(library: Path) -> list[str]:
    """The shared libraries `library` names (its ELF DT_NEEDED entries)."""
    dynamic = subprocess.run(
        ["readelf", "-d", str(library)], capture_output=True, text=True, check=True
    )
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic.stdout)


def test_where_the_compiler_links_libstdcxx_statically_the_package_links_the_shared_one(
    two_heads: Opened, tmp_path: Path
) -> None:
    """TwoHeads was compiled by a compiler that finds only libstdc++'s static archive and adds
    -static-libstdc++ (as a GPU image's relocated GCC did: a model's library then holds a copy
    of libstdc++ that clashes with torch's, and making its container crashed the process).
    model-archiver names the shared runtime's file, so the library needs it and makes its
    container beside torch's."""
    links = static_cxx_links()
    assert any("-shared" in link for link in links), "the wrapped compiler made no library"
    library = read_package(two_heads.package).extract(tmp_path)

    assert "libstdc++.so.6" in needed(library)
    loaded = AotiLibrary(library)  # torch is imported here: its libstdc++ is loaded
    container = loaded.create(1, "cpu")
    try:
        a = torch.from_numpy(rows(3, width=256, seed=2))
        b = torch.from_numpy(rows(3, width=4, seed=3))
        y, z = loaded.run(container, [a, b], 2)
    finally:
        loaded.delete(container)
        loaded.close()
    expected_y, expected_z = two_heads_reference(a.numpy(), b.numpy())
    np.testing.assert_allclose(y.numpy(), expected_y, atol=1e-4, rtol=0)
    np.testing.assert_allclose(z.numpy(), expected_z, atol=1e-4, rtol=0)


@pytest.mark.parametrize("static", [True, False], ids=["static", "shared"])
def test_a_library_with_a_cxx_runtime_of_its_own_is_refused_before_it_is_called(
    tmp_path: Path, static: bool
) -> None:
    """A library built with -static-libstdc++ exports its own std::locale: refused with what
    to do, before a call could crash the process. Built with the shared runtime, the same
    source is refused only for what it lacks of a compiled model."""
    compiler = shutil.which("g++")
    assert compiler is not None
    source = tmp_path / "locale.cpp"
    source.write_text(
        '#include <locale>\nextern "C" int classic_name_size() '
        "{ return static_cast<int>(std::locale::classic().name().size()); }\n"
    )
    library = tmp_path / "locale.so"
    flags = ["-static-libstdc++"] if static else []
    subprocess.run(
        [compiler, "-shared", "-fPIC", str(source), "-o", str(library), *flags], check=True
    )

    with pytest.raises(AotiError) as info:
        AotiLibrary(library)

    message = str(info.value)
    if static:
        assert "carries its own copy of the C++ runtime" in message
        assert "Build it again with this model-archiver" in message
        assert "'aot_inductor.custom_op_libs': [':libstdc++.so.6']" in message
    else:
        assert "the compiled model has no AOTInductorModelContainerCreateWithDevice" in message


# -- refusals at load -----------------------------------------------------------------------
def test_a_package_from_another_torch_release_is_refused(tiny: Opened) -> None:
    with pytest.raises(BackendError) as info:
        tiny.backend(torch_version="2.9.1+cpu")

    message = str(info.value)
    assert "compiled with torch 2.9.1+cpu" in message
    assert f"this server runs torch {torch.__version__}" in message
    assert "rebuild the archive with model-archiver" in message


def test_a_package_for_another_device_is_refused(tiny: Opened) -> None:
    with pytest.raises(BackendError) as info:
        tiny.backend(device="cpu", target_device="cuda")
    assert str(info.value).startswith(
        "the .pt2 package was compiled for cuda and this worker's device is cpu: serve it on a GPU"
    )

    with pytest.raises(BackendError) as info:
        tiny.backend(device="cuda:0")
    assert "compiled for cpu and this worker's device is cuda:0: serve it on CPU" in str(info.value)


def a_feature_this_cpu_lacks() -> str:
    lacking = [k for k, v in torch.cpu.get_capabilities().items() if v is False]
    if not lacking:
        pytest.skip("this CPU has every feature torch knows of")
    return sorted(lacking)[0]


def test_a_package_for_instructions_this_cpu_lacks_is_refused(tiny: Opened) -> None:
    target = tiny.info.target
    lacking = a_feature_this_cpu_lacks()

    with pytest.raises(BackendError) as info:
        tiny.backend(cpu_flags=(*target.cpu_flags, lacking))

    assert str(info.value) == (
        f"the .pt2 package was compiled for {target.isa} -march={target.march} and this CPU "
        f"lacks {lacking}: rebuild the archive with model-archiver on a machine like this one"
    )


def test_an_archive_without_build_information_is_refused(tiny: Opened) -> None:
    assert tiny.manifest.scriptserve is not None
    bare = tiny.manifest.with_scriptserve(dataclasses.replace(tiny.manifest.scriptserve, pt2=None))

    with pytest.raises(BackendError, match=r"records no \.pt2 build information"):
        load_backend(tiny.package, "pt2", manifest=bare)


def test_the_recorded_build_matches_this_machine(tiny: Opened) -> None:
    info = tiny.info
    assert info.torch_version == torch.__version__
    assert info.target.device == "cpu"
    assert info.source == "eager"
    capabilities = torch.cpu.get_capabilities()
    assert info.target.cpu_flags
    assert all(capabilities.get(f) is True for f in info.target.cpu_flags)
    assert info.compile_options["freezing"] is True
    assert info.compile_options["noGrad"] is True


# Features that torch reads from the CPU (CPUID) and a Linux kernel older than them does not
# name in /proc/cpuinfo: the kernel of a 2-core Xeon with AMX here (6.18) lists no AVX10 flag
# where torch reports AVX10.1.
_NEWER_THAN_SOME_KERNELS = {"avx10_1", "avx10_2", "amx_fp16", "amx_complex"}


def test_cpu_features_read_without_torch_are_the_ones_torch_reports() -> None:
    """A server of CPU `.pt2` models checks the CPU's features without importing torch, from
    /proc/cpuinfo: every feature it reads there is one torch reports, under torch's name, and
    every feature torch reports is read there but for those newer than some kernels."""
    from scriptserve.archiver.pt2_package import _cpuinfo_flags

    from_cpuinfo = _cpuinfo_flags()
    assert from_cpuinfo is not None
    known = {k: v for k, v in torch.cpu.get_capabilities().items() if isinstance(v, bool)}
    assert len(known) > 40
    has = {k for k, v in known.items() if v}
    read = {k for k in known if k in set(from_cpuinfo)}
    assert read <= has  # never a feature the CPU lacks
    assert has - read <= _NEWER_THAN_SOME_KERNELS, has - read


def test_a_package_for_this_cpu_is_not_refused_for_a_feature_the_kernel_does_not_name() -> None:
    """A package compiled for -march=native records the features torch reported on the machine
    that archived it. A server without torch reads /proc/cpuinfo, which may not name some of
    them: torch then decides, and the package runs on the machine that made it; a feature the
    CPU lacks still refuses it, with the feature named."""
    script = """
import sys
from scriptserve.archiver.manifest import Pt2Info, Pt2Target
from scriptserve.archiver.pt2_package import compatibility_problem, torch_version
flags = tuple(sys.argv[1].split(","))
target = Pt2Target(device="cpu", isa="AVX2", march="native", cpu_flags=flags)
print(compatibility_problem(Pt2Info(torch_version=torch_version(), target=target), "cpu"))
"""
    capabilities = torch.cpu.get_capabilities()
    has = [k for k, v in capabilities.items() if v is True]
    lacks = [k for k, v in capabilities.items() if v is False] or ["a_feature_no_cpu_has"]
    runs = subprocess.run(
        [sys.executable, "-c", script, ",".join(has)], capture_output=True, text=True, check=True
    )
    assert runs.stdout.strip() == "None", runs.stdout
    refused = subprocess.run(
        [sys.executable, "-c", script, ",".join([*has, lacks[0]])],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"this CPU lacks {lacks[0]}:" in refused.stdout, refused.stdout


@pytest.mark.gpu
@needs_cuda
def test_a_cpu_package_is_refused_on_cuda_and_runs_on_cpu_beside_it(tiny: Opened) -> None:
    with pytest.raises(BackendError, match="serve it on CPU"):
        tiny.backend(device="cuda:0")
    np.testing.assert_allclose(
        tiny.backend().run({"x": rows(4)})["output0"], reference_output(rows(4)), atol=1e-4
    )


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_package_runs_on_cuda_like_eager_and_is_refused_on_cpu() -> None:
    archive = archive_eager(
        "tiny_pt2_cuda", "TinyMLP", [0.5] * 8, TINY_MAX_BATCH, "--pt2-device", "cuda"
    )
    for cuda in opened(archive):
        assert cuda.info.target.device == "cuda"
        assert (cuda.info.target.cuda_arch or "").startswith("sm_")
        x = rows(TINY_MAX_BATCH, seed=21)

        outputs = cuda.backend(device="cuda:0").run({"x": x})

        np.testing.assert_allclose(outputs["output0"], reference_output(x), atol=1e-3, rtol=0)
        with pytest.raises(BackendError, match="serve it on a GPU"):
            cuda.backend(device="cpu")

        # CUDA graphs: every batch size answers as without them, padded to its bucket.
        graphed = cuda.backend(device="cuda:0", options={"cuda_graphs": True})
        plain = cuda.backend(device="cuda:0")
        for batch in sorted({1, 3, TINY_MAX_BATCH // 2 + 1, TINY_MAX_BATCH}):
            x = rows(batch, seed=batch)
            np.testing.assert_allclose(
                graphed.run({"x": x})["output0"], plain.run({"x": x})["output0"], atol=1e-5
            )
