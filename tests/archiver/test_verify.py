"""Tampered archives fail verification, naming the file that differs."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ArchiveFactory
from serving import run_command

from scriptserve.archiver.archive import ArchiveError, VerifyReport, open_archive, verify_archive

Members = dict[str, bytes]


def rewrite(archive: Path, change: Callable[[Members], None]) -> None:
    """Rewrite a zip or tar.gz archive with `change` applied to its {name: bytes} members."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            compression = zf.infolist()[0].compress_type
            members = {i.filename: zf.read(i) for i in zf.infolist()}
        change(members)
        with zipfile.ZipFile(archive, "w", compression=compression) as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return
    with tarfile.open(archive, "r:gz") as tf:
        members = {}
        for m in tf.getmembers():
            fh = tf.extractfile(m)
            assert fh is not None
            members[m.name.removeprefix("tiny/")] = fh.read()
    change(members)
    with tarfile.open(archive, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(f"tiny/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def change_model(members: Members) -> None:
    members["tiny.pt"] = flip_last_byte(members["tiny.pt"])


def drop_sample(members: Members) -> None:
    del members["sample.json"]


def add_extra(members: Members) -> None:
    members["evil.py"] = b"import os\n"


TAMPERING = [
    pytest.param(change_model, VerifyReport(changed=("tiny.pt",)), id="changed"),
    pytest.param(drop_sample, VerifyReport(missing=("sample.json",)), id="missing"),
    pytest.param(add_extra, VerifyReport(extra=("evil.py",)), id="extra"),
]


def scriptserve(*args: str) -> subprocess.CompletedProcess[str]:
    return run_command("scriptserve", *args)


@pytest.mark.parametrize("fmt", ["default", "zip-store", "no-archive", "tgz"])
def test_good_archive_verifies(
    fmt: str, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    archive = make_archive(torchscript_file, fmt=fmt)
    report = verify_archive(archive)
    assert report == VerifyReport()
    assert report.ok
    assert report.reason() == "all files match their SHA-256"


@pytest.mark.parametrize("fmt", ["default", "zip-store", "tgz"])
@pytest.mark.parametrize(("tamper", "expected"), TAMPERING)
def test_tampered_archive_fails_naming_the_file(
    fmt: str,
    tamper: Callable[[Members], None],
    expected: VerifyReport,
    torchscript_file: Path,
    make_archive: ArchiveFactory,
    tmp_path: Path,
) -> None:
    archive = make_archive(torchscript_file, fmt=fmt)
    rewrite(archive, tamper)

    report = verify_archive(archive)
    assert report == expected
    assert not report.ok
    (name,) = report.changed + report.missing + report.extra
    assert name in report.reason()

    workdir = tmp_path / "work"
    workdir.mkdir()
    with pytest.raises(ArchiveError, match="failed verification") as exc:
        open_archive(archive, verify=True, workdir=workdir)
    assert name in str(exc.value)
    assert list(workdir.iterdir()) == []  # the refused archive's temp folder is gone

    # Without verification it opens, and the reader reports the same.
    with open_archive(archive, verify=False, workdir=workdir) as reader:
        assert reader.verify() == expected
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize(("tamper", "expected"), TAMPERING)
def test_no_archive_directory_edited_in_place_fails(
    tamper: Callable[[Members], None],
    expected: VerifyReport,
    torchscript_file: Path,
    make_archive: ArchiveFactory,
) -> None:
    directory = make_archive(torchscript_file, fmt="no-archive")
    members = {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file()
    }
    before = dict(members)
    tamper(members)
    for name in before.keys() - members.keys():
        (directory / name).unlink()
    for name, data in members.items():
        if before.get(name) != data:
            (directory / name).write_bytes(data)

    assert verify_archive(directory) == expected
    with pytest.raises(ArchiveError, match="failed verification"):
        open_archive(directory)


def test_changed_manifest_hash_fails(torchscript_file: Path, make_archive: ArchiveFactory) -> None:
    archive = make_archive(torchscript_file)

    def swap_hash(members: Members) -> None:
        data = json.loads(members["MAR-INF/MANIFEST.json"])
        data["scriptserve"]["files"]["sample.json"] = "0" * 64
        members["MAR-INF/MANIFEST.json"] = json.dumps(data).encode()

    rewrite(archive, swap_hash)
    assert verify_archive(archive).changed == ("sample.json",)


def test_cli_verify_exit_codes(
    torchscript_file: Path, make_archive: ArchiveFactory, tmp_path: Path
) -> None:
    good = make_archive(torchscript_file, export=tmp_path / "good")
    done = scriptserve("archive", "verify", str(good))
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout

    bad = make_archive(torchscript_file, export=tmp_path / "bad")
    rewrite(bad, change_model)
    done = scriptserve("archive", "verify", str(bad))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("scriptserve archive: error:")
    assert "verification failed" in line
    assert "changed: tiny.pt" in line
    assert done.stdout == ""


@pytest.mark.parametrize("name", ["tiny\n", "tiny\nFORGED", "-tiny", "", "ti ny", "tiny/x"])
def test_model_names_are_letters_digits_and_separators_only(name: str) -> None:
    from scriptserve.archiver.manifest import ManifestError, check_model_name

    with pytest.raises(ManifestError, match="invalid model name"):
        check_model_name(name)
    assert check_model_name("tiny-2.0_b") == "tiny-2.0_b"
