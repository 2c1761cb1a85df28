"""Safe extraction of zip and tar archives into a fresh directory.

Every entry is checked before any byte is written: no absolute paths, no `..`, no links, no
device files or fifos, no duplicate names, and declared sizes within `ExtractionLimits` (total
bytes, entry count, compression ratio). Writing then streams each file with `O_EXCL|O_NOFOLLOW`
and counts the bytes it really writes, so a header that lies about a size cannot grow the output.
"""

from __future__ import annotations

import os
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

_CHUNK = 1 << 20
# Small files (JSON, text) compress far better than model weights; ratio checks start above this.
_RATIO_FLOOR_BYTES = 1 << 20


class UnsafeArchiveError(ValueError):
    """An archive entry that would escape the destination or exhaust resources."""


@dataclass(frozen=True)
class ExtractionLimits:
    """Bounds on what one archive may unpack to."""

    max_total_bytes: int = 8 << 30
    """Sum of all uncompressed file sizes."""
    max_entries: int = 10_000
    """Number of entries (files and directories)."""
    max_ratio: float = 200.0
    """Uncompressed to compressed size, per entry and for the whole archive."""


@dataclass(frozen=True)
class _Entry:
    name: str
    is_dir: bool
    size: int
    compressed_size: int


def check_entry_name(name: str) -> str:
    """Return the normalised relative POSIX path of an entry, or raise UnsafeArchiveError."""
    if not name or "\x00" in name:
        raise UnsafeArchiveError("archive entry with an empty or NUL-containing name")
    if "\\" in name:
        raise UnsafeArchiveError(f"archive entry {name!r} uses a backslash; use '/' separators")
    path = PurePosixPath(name)
    if path.is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"archive entry {name!r} has an absolute path")
    parts = [p for p in path.parts if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchiveError(f"archive entry {name!r} points outside the archive ('..')")
    if not parts:
        raise UnsafeArchiveError(f"archive entry {name!r} has no file name")
    return "/".join(parts)


def _zip_entries(zf: zipfile.ZipFile) -> list[_Entry]:
    entries = []
    for info in zf.infolist():
        mode = info.external_attr >> 16
        kind = stat.S_IFMT(mode)
        if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "a special file"
            raise UnsafeArchiveError(f"archive entry {info.filename!r} is {what}")
        entries.append(_Entry(info.filename, info.is_dir(), info.file_size, info.compress_size))
    return entries


def _tar_entries(tf: tarfile.TarFile, limits: ExtractionLimits) -> list[_Entry]:
    entries = []
    total = 0
    for member in tf:
        if member.issym() or member.islnk():
            raise UnsafeArchiveError(f"archive entry {member.name!r} is a link")
        if not (member.isfile() or member.isdir()):
            raise UnsafeArchiveError(f"archive entry {member.name!r} is a special file")
        entries.append(_Entry(member.name, member.isdir(), member.size, member.size))
        total += member.size
        # Checked while listing: a gzip bomb must not be read to its end first.
        if len(entries) > limits.max_entries or total > limits.max_total_bytes:
            _check_totals(entries, limits, archive_bytes=None)
    return entries


def _check_totals(
    entries: list[_Entry], limits: ExtractionLimits, archive_bytes: int | None
) -> None:
    if len(entries) > limits.max_entries:
        raise UnsafeArchiveError(
            f"archive has more than {limits.max_entries} entries; raise the entry limit if intended"
        )
    total = sum(e.size for e in entries)
    if total > limits.max_total_bytes:
        raise UnsafeArchiveError(
            f"archive unpacks to more than {limits.max_total_bytes} bytes; "
            "raise the size limit if the model is really that large"
        )
    for e in entries:
        if e.size > _RATIO_FLOOR_BYTES and e.size > limits.max_ratio * max(e.compressed_size, 1):
            raise UnsafeArchiveError(
                f"archive entry {e.name!r} expands more than {limits.max_ratio:g}x "
                "(decompression bomb?)"
            )
    compressed = max(archive_bytes or 0, 1)
    if archive_bytes is not None and _RATIO_FLOOR_BYTES < total > limits.max_ratio * compressed:
        raise UnsafeArchiveError(
            f"archive expands more than {limits.max_ratio:g}x (decompression bomb?)"
        )


def _check_names(entries: list[_Entry]) -> dict[str, _Entry]:
    seen: dict[str, _Entry] = {}
    for e in entries:
        key = check_entry_name(e.name)
        if key in seen and not (e.is_dir and seen[key].is_dir):
            raise UnsafeArchiveError(f"archive has two entries named {key!r}")
        seen[key] = e
    files = {k for k, e in seen.items() if not e.is_dir}
    for key in seen:
        parent = PurePosixPath(key).parent
        while str(parent) != ".":
            if str(parent) in files:
                raise UnsafeArchiveError(f"archive entry {key!r} lies under the file {parent}")
            parent = parent.parent
    return seen


def _within(root: Path, target: Path) -> bool:
    # commonpath, not startswith: '/store/abc' must not admit '/store/abcd/x'.
    return os.path.commonpath([root, target]) == str(root)


@contextmanager
def _open_exclusive(target: Path) -> Iterator[IO[bytes]]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(target, flags, 0o644)
    with os.fdopen(fd, "wb") as fh:
        yield fh


def _copy_bounded(src: IO[bytes], dst: IO[bytes], name: str, declared: int) -> int:
    written = 0
    while chunk := src.read(_CHUNK):
        written += len(chunk)
        if written > declared:
            raise UnsafeArchiveError(f"archive entry {name!r} is larger than its header says")
        dst.write(chunk)
    return written


def safe_extract(archive: Path, dest: Path, limits: ExtractionLimits | None = None) -> None:
    """Unpack a zip or tar archive into the empty directory `dest`, or raise UnsafeArchiveError."""
    limits = limits or ExtractionLimits()
    root = dest.resolve()
    if any(root.iterdir()):
        raise UnsafeArchiveError("extraction needs an empty destination directory")
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            entries = _zip_entries(zf)
            _check_totals(entries, limits, archive.stat().st_size)
            names = _check_names(entries)
            for key, e in names.items():
                target = _prepare(root, key, e.is_dir)
                if target is not None:
                    with zf.open(e.name) as src, _open_exclusive(target) as dst:
                        _copy_bounded(src, dst, key, e.size)
        return
    if not tarfile.is_tarfile(archive):
        raise UnsafeArchiveError("not a zip or tar archive")
    with tarfile.open(archive, "r:*") as tf:
        entries = _tar_entries(tf, limits)
        _check_totals(entries, limits, archive.stat().st_size)
        names = _check_names(entries)
        members = {check_entry_name(m.name): m for m in tf.getmembers()}
        for key, e in names.items():
            target = _prepare(root, key, e.is_dir)
            if target is not None:
                member = tf.extractfile(members[key])
                if member is None:
                    raise UnsafeArchiveError(f"archive entry {key!r} cannot be read")
                with member, _open_exclusive(target) as dst:
                    _copy_bounded(member, dst, key, e.size)


def _prepare(root: Path, key: str, is_dir: bool) -> Path | None:
    """Create the directories for an entry; return the file path to write, None for a dir."""
    target = root / key
    parent = target if is_dir else target.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not _within(root, parent.resolve()):
        raise UnsafeArchiveError(f"archive entry {key!r} points outside the archive")
    return None if is_dir else target
