"""The wheel holds one import package, `scriptserve`, with every module, the .proto sources and
py.typed, at the one version string; and pyproject's explicit package list misses no folder."""

from __future__ import annotations

import email.parser
import sys
import zipfile
from pathlib import Path

import scriptserve

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("archiver", "handlers", "server", "training")
DIST_INFO = f"scriptserve-{scriptserve.__version__}.dist-info"


def subpackage_files(checkout_files: list[str]) -> list[str]:
    return [name for name in checkout_files if name.split("/", 1)[0] in SUBPACKAGES]


def test_one_top_level_package(wheel_names: list[str]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel_names}
    assert tops == {"scriptserve", DIST_INFO}, sorted(tops)
    with_modules = {name for name in wheel_names if name.endswith(".py")}
    assert with_modules and all(name.startswith("scriptserve/") for name in with_modules)


def test_top_level_txt_names_only_scriptserve(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        top_level = archive.read(f"{DIST_INFO}/top_level.txt").decode().split()
    assert top_level == ["scriptserve"]


def test_every_file_of_the_checkout_ships(
    wheel_names: list[str], checkout_files: list[str]
) -> None:
    """Each file of the four subpackages (modules, stubs, .proto sources) and the package's own
    files are in the wheel under scriptserve/; nothing from tests/, benchmarks/, scripts/ or
    docs/ is."""
    shipped = set(wheel_names)
    wanted = [*subpackage_files(checkout_files), "__init__.py", "__main__.py", "py.typed"]
    missing = sorted(name for name in wanted if f"scriptserve/{name}" not in shipped)
    assert not missing, f"not in the wheel: {missing}"
    for folder in ("tests", "benchmarks", "scripts", "docs", "model_store", "docker", "ts"):
        assert not any(n.startswith(f"scriptserve/{folder}/") for n in shipped), folder


def test_proto_sources_and_py_typed_ship(wheel_names: list[str]) -> None:
    protos = {n.rsplit("/", 1)[-1] for n in wheel_names if n.endswith(".proto")}
    assert protos == {"inference.proto", "management.proto", "open_inference_grpc.proto"}
    assert all(
        n.startswith("scriptserve/server/grpc/proto/") for n in wheel_names if n.endswith(".proto")
    )
    assert "scriptserve/py.typed" in wheel_names


def test_version_is_the_package_version(wheel: Path) -> None:
    assert wheel.name.startswith(f"scriptserve-{scriptserve.__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        metadata = email.parser.Parser().parsestr(archive.read(f"{DIST_INFO}/METADATA").decode())
    assert metadata["Name"] == "scriptserve"
    assert metadata["Version"] == scriptserve.__version__


def test_url_registration_needs_no_extra(wheel: Path) -> None:
    """httpx downloads archives registered by URL, so it is a runtime dependency, not dev's."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = email.parser.Parser().parsestr(archive.read(f"{DIST_INFO}/METADATA").decode())
    runtime = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert any(r.replace(" ", "").startswith("httpx>=") for r in runtime), runtime


def test_package_list_names_every_folder(checkout_files: list[str]) -> None:
    """pyproject lists packages explicitly (the repository root is the package directory);
    every folder of the four subpackages that holds Python code must be listed, with an
    __init__.py, or its modules would be left out of the wheel."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    modules = [name for name in subpackage_files(checkout_files) if name.endswith(".py")]
    folders = {str(Path(name).parent) for name in modules}
    expected = {"scriptserve"} | {"scriptserve." + f.replace("/", ".") for f in folders}
    assert sorted(listed - expected) == [], "listed in pyproject but not a folder of modules"
    assert sorted(expected - listed) == [], "folders of modules missing from pyproject's list"
    no_init = sorted(f for f in folders if not (REPO / f / "__init__.py").is_file())
    assert no_init == [], "folders of modules without an __init__.py"
