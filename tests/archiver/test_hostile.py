"""Hostile archives are refused before any byte lands outside a fresh temp directory.

Each archive is crafted here with zipfile/tarfile and carries a valid manifest and model entry,
so only the hostile entry is wrong. Names that would escape are aimed inside `tmp_path`, whose
whole tree is compared before and after: nothing may be written anywhere, and the temporary
extraction folder under `workdir` must be gone.
"""

from __future__ import annotations

import io
import stat
import subprocess
import tarfile
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from serving import run_command
from testmodels import save_torchscript

from scriptserve.archiver.archive import ArchiveError, open_archive, sha256_file
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.extract import ExtractionLimits, UnsafeArchiveError, safe_extract
from scriptserve.archiver.manifest import MANIFEST_PATH, Manifest, ModelInfo, ScriptserveInfo
from scriptserve.archiver.model_file import ModelFileError, check_onnx_external_data
from scriptserve.handlers.base import HandlerError
from scriptserve.server.cli import predict

MANIFEST = Manifest(
    model=ModelInfo("hostile", "1.0", "tensor", serialized_file="model.pt")
).to_json()
MiB = 1 << 20

ZipEntry = tuple[zipfile.ZipInfo, bytes]
TarEntry = tuple[tarfile.TarInfo, bytes]


def zentry(name: str, data: bytes = b"x", mode: int = stat.S_IFREG | 0o644) -> ZipEntry:
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info, data


def tentry(
    name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, linkname: str = ""
) -> TarEntry:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mode = 0o644
    return info, data


def write_zip(path: Path, hostile: list[ZipEntry]) -> Path:
    entries = [zentry(MANIFEST_PATH, MANIFEST.encode()), zentry("model.pt", b"weights")]
    with zipfile.ZipFile(path, "w") as zf:
        for info, data in entries + hostile:
            zf.writestr(info, data)
    return path


def write_tar(path: Path, hostile: list[TarEntry]) -> Path:
    entries = [tentry(MANIFEST_PATH, MANIFEST.encode()), tentry("model.pt", b"weights")]
    with tarfile.open(path, "w:gz") as tf:
        for info, data in entries + hostile:
            tf.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def snapshot(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


class Scene:
    """`tmp_path` split into `inbox` (the crafted archive), `work` (temp dirs) and `dest`."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.inbox = tmp_path / "inbox"
        self.work = tmp_path / "work"
        self.dest = tmp_path / "work" / "dest"
        for d in (self.inbox, self.dest):
            d.mkdir(parents=True)

    def refused(
        self,
        archive: Path,
        match: str,
        targets: list[str],
        limits: ExtractionLimits | None = None,
    ) -> None:
        """Both entry points refuse `archive`, and nothing at all is written under tmp_path."""
        before = snapshot(self.tmp)
        with pytest.raises(UnsafeArchiveError, match=match):
            safe_extract(archive, self.dest, limits)
        assert list(self.dest.iterdir()) == []  # checked before a single byte was written

        self.dest.rmdir()
        with pytest.raises(ArchiveError, match=match) as exc:
            open_archive(archive, limits=limits, workdir=self.work)
        assert str(exc.value).startswith(f"{archive.name}: ")
        assert list(self.work.iterdir()) == []  # the temp extraction folder is gone
        self.dest.mkdir()

        assert snapshot(self.tmp) == before
        for target in targets:
            assert not (self.tmp / target).exists(), target
            assert not (self.tmp / target).is_symlink(), target


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    return Scene(tmp_path)


@pytest.mark.parametrize("container", ["zip", "tar"])
def test_crafted_archive_without_hostile_entry_opens(scene: Scene, container: str) -> None:
    archive = scene.inbox / f"ok.{container}"
    if container == "zip":
        write_zip(archive, [zentry("extra/notes.txt", b"fine")])
    else:
        write_tar(archive, [tentry("extra/notes.txt", b"fine")])
    with open_archive(archive, workdir=scene.work) as reader:
        assert reader.manifest.model.model_name == "hostile"
        assert reader.manifest.scriptserve is None
        assert (reader.root / "model.pt").read_bytes() == b"weights"
        assert (reader.root / "extra" / "notes.txt").read_bytes() == b"fine"
        assert reader.root.is_relative_to(scene.work)
    assert list(scene.work.iterdir()) == [scene.dest]


TRAVERSAL = [
    pytest.param("../evil", "outside the archive", ["work/evil"], id="dotdot"),
    pytest.param("../../evil", "outside the archive", ["evil"], id="dotdot2"),
    pytest.param("a/../../x", "outside the archive", ["work/x", "x"], id="inner-dotdot"),
    pytest.param("./../evil", "outside the archive", ["work/evil"], id="dot-dotdot"),
    pytest.param("{tmp}/abs_evil", "absolute path", ["abs_evil"], id="absolute"),
    pytest.param("/abs/path", "absolute path", [], id="abs-root"),
    pytest.param("C:/evil", "absolute path", ["C:"], id="drive"),
    pytest.param("..\\evil", "backslash", ["work/evil", "..\\evil"], id="backslash"),
]


@pytest.mark.parametrize("container", ["zip", "tar"])
@pytest.mark.parametrize(("name", "match", "targets"), TRAVERSAL)
def test_path_traversal_is_refused(
    scene: Scene, container: str, name: str, match: str, targets: list[str]
) -> None:
    name = name.format(tmp=scene.tmp)
    if container == "zip":
        archive = write_zip(scene.inbox / "m.mar", [zentry(name, b"pwned")])
    else:
        archive = write_tar(scene.inbox / "m.tar.gz", [tentry(name, b"pwned")])
    scene.refused(archive, match, targets)
    assert not Path("/abs/path").exists()


@pytest.mark.parametrize("container", ["zip", "tar"])
def test_prefix_collision_is_refused(scene: Scene, container: str) -> None:
    # The TorchServe bug: '/store/abc' startswith-matched '/store/abcd/x'.
    root = scene.tmp / "store" / "abc"
    root.mkdir(parents=True)
    name = "../abcd/x"
    if container == "zip":
        archive = write_zip(scene.inbox / "m.mar", [zentry(name)])
    else:
        archive = write_tar(scene.inbox / "m.tar.gz", [tentry(name)])
    with pytest.raises(UnsafeArchiveError, match="outside the archive"):
        safe_extract(archive, root)
    assert list(root.iterdir()) == []
    assert not (scene.tmp / "store" / "abcd").exists()

    # The same trick against open_archive's temp folder inside `work`: aim at a sibling 'workx'.
    collide = "../../workx/y"
    if container == "zip":
        archive = write_zip(scene.inbox / "c.mar", [zentry(collide)])
    else:
        archive = write_tar(scene.inbox / "c.tar.gz", [tentry(collide)])
    scene.refused(archive, "outside the archive", ["workx", "workx/y"])


def test_zip_symlink_entry_is_refused(scene: Scene) -> None:
    link = zentry("link", str(scene.tmp / "outside").encode(), stat.S_IFLNK | 0o777)
    archive = write_zip(scene.inbox / "m.mar", [link, zentry("link/evil", b"pwned")])
    scene.refused(archive, "'link' is a symbolic link", ["outside", "outside/evil"])


@pytest.mark.parametrize(
    "mode", [stat.S_IFCHR | 0o666, stat.S_IFBLK | 0o666, stat.S_IFIFO | 0o644], ids=str
)
def test_zip_special_file_entry_is_refused(scene: Scene, mode: int) -> None:
    archive = write_zip(scene.inbox / "m.mar", [zentry("dev", b"", mode)])
    scene.refused(archive, "'dev' is a special file", [])


@pytest.mark.parametrize(
    ("kind", "linkname"),
    [
        pytest.param(tarfile.SYMTYPE, "{tmp}/outside", id="symlink-absolute"),
        pytest.param(tarfile.SYMTYPE, "../../../outside", id="symlink-relative"),
        pytest.param(tarfile.SYMTYPE, "model.pt", id="symlink-inside"),
        pytest.param(tarfile.LNKTYPE, "/etc/passwd", id="hardlink-absolute"),
        pytest.param(tarfile.LNKTYPE, "../../outside", id="hardlink-relative"),
        pytest.param(tarfile.LNKTYPE, "model.pt", id="hardlink-inside"),
    ],
)
def test_tar_links_are_refused(scene: Scene, kind: bytes, linkname: str) -> None:
    (scene.tmp / "victim").write_text("keep")
    link = tentry("link", kind=kind, linkname=linkname.format(tmp=scene.tmp))
    # The classic follow-up: write through the link once it exists.
    archive = write_tar(scene.inbox / "m.tar.gz", [link, tentry("link/evil", b"pwned")])
    scene.refused(archive, "'link' is a link", ["outside", "outside/evil"])
    assert (scene.tmp / "victim").read_text() == "keep"


@pytest.mark.parametrize(
    "kind",
    [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE],
    ids=["chardev", "blockdev", "fifo"],
)
def test_tar_device_and_fifo_are_refused(scene: Scene, kind: bytes) -> None:
    info, _ = tentry("dev", kind=kind)
    info.devmajor, info.devminor = 1, 3
    archive = write_tar(scene.inbox / "m.tar.gz", [(info, b"")])
    scene.refused(archive, "'dev' is a special file", [])


@pytest.mark.parametrize(
    ("names", "match"),
    [
        pytest.param(["model.pt"], "two entries named 'model.pt'", id="same-name"),
        pytest.param(["./model.pt"], "two entries named 'model.pt'", id="dot-slash"),
        pytest.param(["a//b", "a/b"], "two entries named 'a/b'", id="double-slash"),
        pytest.param([MANIFEST_PATH], "two entries named 'MAR-INF/MANIFEST.json'", id="manifest"),
        pytest.param(["model.pt/x"], "lies under the file model.pt", id="under-a-file"),
    ],
)
@pytest.mark.parametrize("container", ["zip", "tar"])
def test_duplicate_names_are_refused(
    scene: Scene, container: str, names: list[str], match: str
) -> None:
    if container == "zip":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Duplicate name", UserWarning)
            archive = write_zip(scene.inbox / "m.mar", [zentry(n, b"second") for n in names])
    else:
        archive = write_tar(scene.inbox / "m.tar.gz", [tentry(n, b"second") for n in names])
    scene.refused(archive, match, [])


def zip_bomb(path: Path, size: int) -> Path:
    """A valid archive plus one entry of `size` zero bytes, deflated ~1000x."""
    write_zip(path, [])
    with (
        zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED, compresslevel=9) as zf,
        zf.open("bomb.bin", "w") as fh,
    ):
        for _ in range(size // MiB):
            fh.write(bytes(MiB))
    return path


def tar_bomb(path: Path, size: int) -> Path:
    info, _ = tentry("bomb.bin")
    info.size = size
    with tarfile.open(path, "w:gz", compresslevel=9) as tf:
        for entry, data in [tentry(MANIFEST_PATH, MANIFEST.encode()), tentry("model.pt")]:
            tf.addfile(entry, io.BytesIO(data))
        tf.addfile(info, io.BytesIO(bytes(size)))
    return path


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        pytest.param(
            ExtractionLimits(max_total_bytes=10 * MiB), "unpacks to more than 10485760", id="total"
        ),
        pytest.param(
            ExtractionLimits(max_ratio=10), "'bomb.bin' expands more than 10x", id="ratio"
        ),
    ],
)
def test_zip_bomb_is_refused_before_inflating(
    scene: Scene, limits: ExtractionLimits, match: str
) -> None:
    archive = zip_bomb(scene.inbox / "bomb.mar", 50 * MiB)
    assert archive.stat().st_size < MiB
    tracemalloc.start()
    try:
        scene.refused(archive, match, [], limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB  # nothing was inflated into memory


def test_zip_bomb_is_refused_with_default_limits(scene: Scene) -> None:
    archive = zip_bomb(scene.inbox / "bomb.mar", 8 * MiB)
    scene.refused(archive, r"'bomb.bin' expands more than 200x \(decompression bomb\?\)", [])


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        pytest.param(None, r"archive expands more than 200x", id="default-ratio"),
        pytest.param(
            ExtractionLimits(max_total_bytes=4 * MiB), "unpacks to more than 4194304", id="total"
        ),
    ],
)
def test_tar_bomb_is_refused(scene: Scene, limits: ExtractionLimits | None, match: str) -> None:
    archive = tar_bomb(scene.inbox / "bomb.tar.gz", 8 * MiB)
    assert archive.stat().st_size < MiB
    scene.refused(archive, match, [], limits)


def test_file_under_the_ratio_floor_is_accepted(scene: Scene) -> None:
    # Small, highly compressible files (JSON, vocabularies) are normal: below 1 MiB no ratio check.
    archive = write_zip(scene.inbox / "ok.mar", [zentry("vocab.txt", bytes(MiB // 2))])
    with open_archive(archive, workdir=scene.work) as reader:
        assert (reader.root / "vocab.txt").stat().st_size == MiB // 2


@pytest.mark.parametrize("container", ["zip", "tar"])
def test_too_many_entries_are_refused(scene: Scene, container: str) -> None:
    names = [f"f{i}.txt" for i in range(10)]
    if container == "zip":
        archive = write_zip(scene.inbox / "m.mar", [zentry(n) for n in names])
    else:
        archive = write_tar(scene.inbox / "m.tar.gz", [tentry(n) for n in names])
    scene.refused(archive, "more than 5 entries", [], ExtractionLimits(max_entries=5))


def test_too_many_entries_with_default_limit(scene: Scene) -> None:
    archive = scene.inbox / "many.mar"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(MANIFEST_PATH, MANIFEST)
        for i in range(10_000):
            zf.writestr(f"d/{i}", b"")
    scene.refused(archive, "more than 10000 entries", [])


def corrupt_deflated(scene: Scene) -> Path:
    archive = write_zip(scene.inbox / "m.mar", [zentry("data.bin", bytes(range(256)) * 64)])
    raw = bytearray(archive.read_bytes())
    start = raw.index(b"data.bin") + len("data.bin")  # the local header's name, then the data
    raw[start + 10 : start + 20] = bytes(10)
    archive.write_bytes(bytes(raw))
    return archive


def corrupt_stored(scene: Scene) -> Path:
    archive = scene.inbox / "m.mar"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(MANIFEST_PATH, MANIFEST)
        zf.writestr("model.pt", b"weights-weights-weights")
    raw = archive.read_bytes()
    archive.write_bytes(raw.replace(b"weights-weights", b"WEIGHTS-weights", 1))  # CRC mismatch
    return archive


def truncated_tgz(scene: Scene) -> Path:
    archive = write_tar(
        scene.inbox / "m.tar.gz", [tentry("data.bin", np.random.default_rng(0).bytes(64_000))]
    )
    raw = archive.read_bytes()
    archive.write_bytes(raw[: len(raw) // 2])
    return archive


@pytest.mark.parametrize("make", [corrupt_deflated, corrupt_stored, truncated_tgz])
def test_corrupt_archive_is_an_archive_error(scene: Scene, make: Callable[[Scene], Path]) -> None:
    archive = make(scene)
    before = snapshot(scene.tmp)
    with pytest.raises(ArchiveError, match=rf"^{archive.name}: .*corrupt"):
        open_archive(archive, workdir=scene.work)
    assert list(scene.work.iterdir()) == [scene.dest]
    assert snapshot(scene.tmp) == before

    done = run_command("scriptserve", "archive", "verify", str(archive))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"scriptserve archive: error: {archive.name}: ")


def test_not_an_archive_is_an_archive_error(scene: Scene) -> None:
    path = scene.inbox / "junk.mar"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ArchiveError, match=r"junk\.mar is not a model archive"):
        open_archive(path, workdir=scene.work)
    assert list(scene.work.iterdir()) == [scene.dest]


def test_no_archive_directory_with_a_symlink_is_refused(scene: Scene) -> None:
    outside = scene.tmp / "secret.txt"
    outside.write_text("secret")
    directory = scene.inbox / "linked"
    (directory / "MAR-INF").mkdir(parents=True)
    # The recorded hash even matches what the link points to: the link itself is refused.
    section = ScriptserveInfo("torchscript", {"model.pt": sha256_file(outside)})
    manifest = Manifest(ModelInfo("linked", "1.0", "tensor", serialized_file="model.pt"))
    (directory / MANIFEST_PATH).write_text(manifest.with_scriptserve(section).to_json())
    (directory / "model.pt").symlink_to(outside)
    with pytest.raises(ArchiveError, match=r"'model\.pt' is a link"):
        open_archive(directory)
    assert outside.read_text() == "secret"


def test_torchserve_style_directory_with_a_symlink_is_refused_at_open(scene: Scene) -> None:
    # No scriptserve section means nothing is verified; the link must still be refused.
    outside = scene.tmp / "secret.txt"
    outside.write_text("secret")
    directory = scene.inbox / "ts_linked"
    (directory / "MAR-INF").mkdir(parents=True)
    manifest = Manifest(ModelInfo("ts_linked", "1.0", "tensor", serialized_file="model.pt"))
    (directory / MANIFEST_PATH).write_text(manifest.to_json())
    (directory / "model.pt").symlink_to(outside)
    with pytest.raises(ArchiveError, match=r"'model\.pt' is a link"):
        open_archive(directory, verify=False)


# -- ONNX external data ----------------------------------------------------------------------


def onnx_with_external_data(path: Path, location: str) -> Path:
    """A one-initializer ONNX model whose weights claim to live in the file `location`."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [8, 3], np.zeros(24, np.float32))
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "96")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # Serialize directly: onnx.save would try to resolve the external data itself.
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize(
    "location",
    ["../../etc/passwd", "/etc/passwd", "../secret.bin", "sub/../../secret.bin"],
)
def test_onnx_external_data_outside_the_folder_is_refused(
    tmp_path: Path, location: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "secret.bin").write_bytes(bytes(96))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = onnx_with_external_data(model_dir / "ext.onnx", location)
    with pytest.raises(ModelFileError, match="outside the model folder") as exc:
        check_onnx_external_data(path)
    assert "'w'" in str(exc.value)

    argv = [
        "--model-name",
        "ext",
        "--version",
        "1",
        "--serialized-file",
        str(path),
        "--export-path",
        str(tmp_path / "store"),
    ]
    with pytest.raises(SystemExit) as exit_:
        model_archiver_main(argv)
    assert exit_.value.code == 1
    assert "outside the model folder" in capsys.readouterr().err
    assert not (tmp_path / "store" / "ext.mar").exists()


def test_onnx_external_data_beside_the_model_is_accepted(tmp_path: Path) -> None:
    path = onnx_with_external_data(tmp_path / "ext.onnx", "ext.weights")
    (tmp_path / "ext.weights").write_bytes(np.ones((8, 3), np.float32).tobytes())
    check_onnx_external_data(path)
    onnx.checker.check_model(str(path))


# -- model names -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["../evil", "a/b", ".hidden", "-dash", "_under", "with space", "ünï", "x;rm", ""]
)
def test_invalid_model_name_is_refused(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.pt"
    model.write_bytes(b"never read")
    store = tmp_path / "store"
    argv = [
        f"--model-name={name}",
        "--version",
        "1",
        "--serialized-file",
        str(model),
        "--export-path",
        str(store),
    ]
    with pytest.raises(SystemExit) as exc:
        model_archiver_main(argv)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"model-archiver: error: invalid model name {name!r}")
    assert not store.exists()
    assert not (tmp_path / "evil.mar").exists()


def test_invalid_model_name_exit_code_from_the_console_script(tmp_path: Path) -> None:
    model = tmp_path / "m.pt"
    model.write_bytes(b"never read")
    done = subprocess.run(
        [
            "model-archiver",
            "--model-name",
            "../evil",
            "--version",
            "1",
            "--serialized-file",
            str(model),
            "--export-path",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "model-archiver: error: invalid model name '../evil': use letters, digits, '_', '-' "
        "and '.', starting with a letter or digit"
    ]
    assert not (tmp_path / "evil.mar").exists()


# -- pickles and YAML tags -------------------------------------------------------------------


class _Payload:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.canary}",)


def test_pickle_payload_pt_is_refused_without_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    canary = tmp_path / "canary"
    evil = tmp_path / "evil.pt"
    torch.save({"weights": _Payload(canary)}, evil)  # a state-dict-style pickle, not TorchScript
    argv = [
        "--model-name",
        "evil",
        "--version",
        "1",
        "--serialized-file",
        str(evil),
        "--export-path",
        str(tmp_path / "store"),
    ]
    with pytest.raises(SystemExit) as exc:
        model_archiver_main(argv)
    assert exc.value.code == 1
    assert "does not load as TorchScript" in capsys.readouterr().err
    assert not canary.exists()


def test_yaml_config_with_a_python_tag_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    canary = tmp_path / "canary"
    config = tmp_path / "config.yaml"
    config.write_text(f'boom: !!python/object/apply:os.system ["touch {canary}"]\n')
    model = save_torchscript(tmp_path / "tiny.pt")
    argv = [
        "--model-name",
        "tiny",
        "--version",
        "1",
        "--serialized-file",
        str(model),
        "--input-shape",
        "8",
        "-c",
        str(config),
        "--export-path",
        str(tmp_path / "store"),
    ]
    with pytest.raises(SystemExit) as exc:
        model_archiver_main(argv)
    assert exc.value.code == 1
    assert "--config-file is not valid YAML" in capsys.readouterr().err
    assert not canary.exists()
    assert not (tmp_path / "store" / "tiny.mar").exists()


def test_yaml_config_with_a_python_tag_inside_an_archive_is_refused(
    scene: Scene, sample_file: Path
) -> None:
    # A TorchServe-style archive (no hashes to check): the config is parsed with safe_load only.
    canary = scene.tmp / "canary"
    manifest = Manifest(
        ModelInfo("tiny", "1.0", "tensor", serialized_file="tiny.pt", config_file="config.yaml")
    )
    model = save_torchscript(scene.tmp / "tiny.pt")
    archive = scene.inbox / "tiny.mar"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(MANIFEST_PATH, manifest.to_json())
        zf.write(model, "tiny.pt")
        zf.writestr("config.yaml", f'boom: !!python/object/apply:os.system ["touch {canary}"]\n')
    with pytest.raises(HandlerError, match="not valid YAML"):
        predict(archive, sample_file, "cpu")
    assert not canary.exists()
