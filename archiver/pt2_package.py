"""AOTInductor packages (`.pt2`): what is inside one, what it was compiled for, and whether this
machine can run it.

A package (from `torch._inductor.aoti_compile_and_package`) is a zip whose entries sit under
one top folder. The compiled model is `data/aotinductor/model/<hash>.so`, beside the generated
C++ it was built from (`<hash>.wrapper.cpp`) and `<hash>_metadata.json`, whose
`AOTI_DEVICE_KEY` names the device. The weights are linked into the `.so`. A file saved with
`torch.export.save` is a zip too, with the same extension, holding an ExportedProgram
(`models/*.json`) and no compiled code: `is_exported_program` tells them apart.

    package = read_package(Path("model.pt2"))
    package.device, package.batch_bound()  # ('cpu', 256)
    compatibility_problem(manifest.scriptserve.pt2, "cpu")  # None: this machine can run it
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import sys
import zipfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from scriptserve.archiver.extract import ExtractionLimits
from scriptserve.archiver.manifest import Pt2Info, Pt2Target

MODEL_DIR = "data/aotinductor/model/"
_WEIGHTS_OUTSIDE = ("data/constants/", "data/weights/")
_KERNEL_SUFFIXES = (".cubin", ".fatbin", ".ptx", ".hsaco", ".spv")
_RATIO_FLOOR_BYTES = 1 << 20
"""Entries below this size are not held to the compression ratio limit."""

# The generated wrapper checks each input's sizes (when AOTI_RUNTIME_CHECK_INPUTS is set); its
# messages say which dimensions are fixed and how large a dynamic one may be.
_TOO_LARGE = re.compile(
    r'input_handles\[(\d+)\]: dim value is too large at 0, "\s*<<\s*"expected to be <= (\d+)'
)
_FIXED = re.compile(r'input_handles\[(\d+)\]: unmatched dim value at 0, "\s*<<\s*"expected: (\d+)')


class Pt2PackageError(ValueError):
    """A `.pt2` file that is not a package scriptserve can serve; the message says why."""


def _names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise Pt2PackageError(f"{path.name} is not a .pt2 file (a zip archive): {exc}") from None


def _relative(name: str) -> str:
    """An entry's name below the package's top folder."""
    return name.partition("/")[2]


def is_exported_program(path: Path) -> bool:
    """True for a file saved with torch.export.save: an ExportedProgram and no compiled model."""
    rel = [_relative(n) for n in _names(path)]
    has_program = any(r.startswith("models/") and r.endswith(".json") for r in rel)
    return has_program and not any(r.startswith(MODEL_DIR) for r in rel)


@dataclass(frozen=True)
class Pt2Package:
    """The compiled model of a package: its entries, generated wrapper and metadata."""

    path: Path
    so_entry: str
    kernel_entries: tuple[str, ...]
    wrapper: str
    """The generated C++ (wrapper and kernels), with the compiler commands that built it."""
    metadata: dict[str, Any]

    @property
    def device(self) -> str:
        """'cpu' or 'cuda', as the package's metadata records it."""
        return str(self.metadata.get("AOTI_DEVICE_KEY", "cpu")).partition(":")[0]

    def fixed_batch(self) -> int | None:
        """The batch size the package takes, when it was exported with a fixed one."""
        sizes = {int(m.group(2)) for m in _FIXED.finditer(self.wrapper)}
        return min(sizes) if sizes else None

    def batch_bound(self) -> int | None:
        """The largest batch the package was exported for (its Dim's max); None when the
        generated code records no bound."""
        bounds = [int(m.group(2)) for m in _TOO_LARGE.finditer(self.wrapper)]
        return min(bounds) if bounds else None

    def uses_proxy_executor(self) -> bool:
        """The compiled code calls operators through PyTorch's proxy executor (custom ops and
        fallbacks without a C shim), which a container run without one cannot do."""
        return "aoti_torch_proxy_executor_call_function" in self.wrapper

    def compile_flags(self) -> list[str]:
        """The flags of the compiler commands recorded at the end of the generated C++."""
        commands = [
            line
            for line in self.wrapper.splitlines()
            if line.startswith("// ") and re.search(r"(g\+\+|clang\+\+|c\+\+|cc) ", line)
        ]
        return [flag for command in commands for flag in command.split() if flag.startswith("-")]

    def extract(self, dest: Path) -> Path:
        """Write the model's `.so` (and its GPU kernel files) into `dest`; returns the `.so`.
        Entries are held to the archives' extraction limits (size, compression ratio)."""
        limits = ExtractionLimits()
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(self.path) as zf:
            for entry in (self.so_entry, *self.kernel_entries):
                info = zf.getinfo(entry)
                ratio = info.file_size / max(1, info.compress_size)
                if info.file_size > limits.max_total_bytes or (
                    info.file_size > _RATIO_FLOOR_BYTES and ratio > limits.max_ratio
                ):
                    raise Pt2PackageError(
                        f"{self.path.name}: {PurePosixPath(entry).name} would unpack to "
                        f"{info.file_size} bytes ({ratio:.0f}x); refusing it"
                    )
                with zf.open(info) as src, (dest / PurePosixPath(entry).name).open("wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
        return dest / PurePosixPath(self.so_entry).name


def read_package(path: Path) -> Pt2Package:
    """The compiled model of the AOTInductor package at `path`; Pt2PackageError when it is not
    one that the C-ABI runtime can serve."""
    names = _names(path)
    below = {n: _relative(n) for n in names}
    files = {
        n: rel[len(MODEL_DIR) :]
        for n, rel in below.items()
        if rel.startswith(MODEL_DIR) and "/" not in rel[len(MODEL_DIR) :] and rel != MODEL_DIR
    }
    libraries = [n for n, rest in files.items() if rest.endswith(".so")]
    if not libraries:
        hint = (
            "it holds an ExportedProgram (torch.export.save): let model-archiver compile it"
            if is_exported_program(path)
            else "make one with torch._inductor.aoti_compile_and_package"
        )
        raise Pt2PackageError(f"{path.name} is not an AOTInductor package with a model: {hint}")
    if len(libraries) > 1:
        raise Pt2PackageError(f"{path.name} holds {len(libraries)} compiled models; expected one")
    if any(_relative(n).startswith(_WEIGHTS_OUTSIDE) and not n.endswith("/") for n in names):
        raise Pt2PackageError(
            f"{path.name} keeps its weights outside the compiled model; compile it with the "
            "default aot_inductor.package_constants_in_so=True"
        )
    with zipfile.ZipFile(path) as zf:
        sources = [n for n, rest in files.items() if rest.endswith(".cpp")]
        wrapper = "\n".join(zf.read(n).decode(errors="replace") for n in sources)
        metadata: dict[str, Any] = {}
        for name in (n for n, rest in files.items() if rest.endswith("_metadata.json")):
            loaded = json.loads(zf.read(name))
            if isinstance(loaded, dict):
                metadata.update(loaded)
    kernels = tuple(n for n, rest in files.items() if rest.endswith(_KERNEL_SUFFIXES))
    return Pt2Package(path, libraries[0], kernels, wrapper, metadata)


# -- the machine a package is compiled for ----------------------------------------------------

# The CPU features each x86-64 micro-architecture level adds (torch.cpu.get_capabilities names).
_X86_64_V2 = ("sse3", "ssse3", "sse4_1", "sse4_2", "popcnt")
_X86_64_V3 = (*_X86_64_V2, "avx", "avx2", "bmi", "bmi2", "f16c", "fma3", "lzcnt")
_X86_64_V4 = (*_X86_64_V3, "avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl")
_LEVELS = {"x86-64-v2": _X86_64_V2, "x86-64-v3": _X86_64_V3, "x86-64-v4": _X86_64_V4}
# Compiler flags (-m...) whose feature name differs from the flag's.
_FEATURE_NAMES = {"fma": "fma3"}


def _feature_name(flag: str) -> str:
    name = flag.removeprefix("-m")
    if name in _FEATURE_NAMES:
        return _FEATURE_NAMES[name]
    if name.startswith("avx512") and name != "avx512":
        return "avx512_" + name.removeprefix("avx512")
    return name.replace("-", "_")


def portable_march(vec_isa: str) -> str | None:
    """The -march level that covers the vector ISA Inductor picked ("avx512 avx512_vnni"): the
    package then runs on every CPU with that ISA, where Inductor's default, -march=native,
    lets the compiler use whatever the compiling CPU has."""
    if vec_isa.startswith("avx512"):
        return "x86-64-v4"
    if vec_isa.startswith("avx2"):
        return "x86-64-v3"
    return None


# /proc/cpuinfo flag -> torch.cpu.get_capabilities() name, where they differ (AVX-512 flags
# gain an underscore after "avx512": avx512f -> avx512_f).
_CPUINFO_NAMES = {"pni": "sse3", "fma": "fma3", "abm": "lzcnt", "bmi1": "bmi", "sha_ni": "sha"}


def _cpuinfo_flags() -> tuple[str, ...] | None:
    """This CPU's features from /proc/cpuinfo, named as torch names them; None without it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((x for x in text.splitlines() if x.startswith("flags")), None)
    if line is None:
        return None
    names = []
    for flag in line.partition(":")[2].split():
        name = _CPUINFO_NAMES.get(flag, flag)
        if name.startswith("avx512") and not name.startswith("avx512_"):
            name = "avx512_" + name.removeprefix("avx512")
        names.append(name)
    return tuple(names)


def cpu_features(exact: bool = False) -> tuple[str, ...]:
    """This CPU's features (torch.cpu.get_capabilities() names). Read from /proc/cpuinfo
    while torch is not imported: a server of `.pt2` models on CPU never imports it. The kernel
    names only the features it knows, where torch reads the CPU's own answer (CPUID): a kernel
    older than a feature (AVX10.1 on a kernel that does not name it) leaves it out. `exact`
    asks torch whatever is imported."""
    if "torch" not in sys.modules and not exact:
        flags = _cpuinfo_flags()
        if flags is not None:
            return flags
    import torch

    return tuple(k for k, v in torch.cpu.get_capabilities().items() if v is True)


_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")


def lacks_vnni(features: Collection[str] | None = None) -> bool:
    """Whether this x86 CPU (or one with `features`) multiplies u8 by s8 without VNNI: its AVX2
    `vpmaddubsw` sums two products in 16 bits, which saturates for 8-bit activations times
    8-bit weights, so int8 models lose accuracy unless one side is 7-bit (reduce_range). False
    on other machines."""
    features = cpu_features() if features is None else features
    return "avx2" in features and not any(f in features for f in _VNNI)


def int8_isa(features: Collection[str] | None = None) -> str:
    """The instructions oneDNN's int8 kernels use on this CPU (or one with `features`): AMX's
    tile multiplies, VNNI's u8 x s8 dot products, or plain AVX2/AVX-512."""
    features = cpu_features() if features is None else features
    for feature, name in (
        ("amx_int8", "AMX"),
        ("avx512_vnni", "AVX512-VNNI"),
        ("avx_vnni", "AVX-VNNI"),
        ("avx512_bw", "AVX512"),
        ("avx2", "AVX2"),
    ):
        if feature in features:
            return name
    return "none"


def torch_version() -> str:
    """The installed torch's version, without importing it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    return importlib.metadata.version("torch")


def package_target(package: Pt2Package) -> Pt2Target:
    """What the package needs, read from its metadata and the compiler commands recorded in
    its generated code. Code compiled for -march=native (or a named CPU) may use any feature
    of the machine that compiled it: the features of this machine are recorded, the one that
    archives it, which has just run it."""
    if package.device == "cuda":
        capability = str(package.metadata.get("AOTI_COMPUTE_CAPABILITY") or "")
        return Pt2Target(device="cuda", cuda_arch=f"sm_{capability}" if capability else None)
    flags = package.compile_flags()
    marches = [f.removeprefix("-march=") for f in flags if f.startswith("-march=")]
    march = marches[-1] if marches else None
    features: tuple[str, ...] = ()
    if march is not None:
        features = _LEVELS.get(march) or cpu_features()
    extensions = [f for f in flags if f.startswith("-m") and not f.startswith(("-march", "-mtune"))]
    return Pt2Target(
        device="cpu",
        isa=str(package.metadata.get("AOTI_CPU_ISA") or "") or None,
        march=march,
        cpu_flags=tuple(dict.fromkeys((*features, *map(_feature_name, extensions)))),
    )


def _release(version: str) -> str:
    """'2.13.0' from '2.13.0+cpu': the local build label does not change the C ABI's version."""
    return version.partition("+")[0]


def compatibility_problem(info: Pt2Info, device: str) -> str | None:
    """Why this machine cannot run the package `info` describes on `device`, or None."""
    rebuild = "rebuild the archive with model-archiver on a machine like this one"
    installed = torch_version()
    if _release(info.torch_version) != _release(installed):
        return (
            f"the .pt2 package was compiled with torch {info.torch_version} and this server runs "
            f"torch {installed}; compiled packages run only on the torch release that "
            f"made them: {rebuild}"
        )
    kind, _, index = device.partition(":")
    target = info.target
    if target.device != kind:
        serve_on = "on CPU" if target.device == "cpu" else "on a GPU"
        return (
            f"the .pt2 package was compiled for {target.device} and this worker's device is "
            f"{device}: serve it {serve_on} (the model config's deviceType), or rebuild the "
            f"archive for {kind}"
        )
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return f"device {device} requested but CUDA is not available"
        major, minor = torch.cuda.get_device_capability(int(index or 0))
        arch = f"sm_{major}{minor}"
        if target.cuda_arch and target.cuda_arch != arch:
            return (
                f"the .pt2 package was compiled for GPU architecture {target.cuda_arch} and "
                f"{device} is {arch}: {rebuild}"
            )
        return None
    missing = [f for f in target.cpu_flags if f not in set(cpu_features())]
    if missing and "torch" not in sys.modules:
        # Read from /proc/cpuinfo, which may not name a feature the CPU has (`cpu_features`):
        # torch, which reads the CPU itself, decides before a package is refused.
        missing = [f for f in target.cpu_flags if f not in set(cpu_features(exact=True))]
    if missing:
        built_for = " ".join(filter(None, (target.isa, target.march and f"-march={target.march}")))
        return (
            f"the .pt2 package was compiled for {built_for or 'another CPU'} and this CPU lacks "
            f"{', '.join(missing)}: {rebuild}"
        )
    return None
