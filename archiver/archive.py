"""Build, open and verify model archives in TorchServe's four formats.

>>> path = build_archive(ArchiveSpec(manifest, files={"model.pt": Path("m.pt")}), Path("store"))
>>> with open_archive(path) as archive:
...     archive.manifest.model.model_name, archive.root / "model.pt"

`default` and `zip-store` are `.mar` zips (deflated / stored), `tgz` is `<name>.tar.gz` with every
file under a top folder `<name>/`, `no-archive` is a plain directory `<export>/<name>/`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from types import TracebackType

from scriptserve.archiver.extract import (
    ExtractionLimits,
    UnsafeArchiveError,
    check_entry_name,
    safe_extract,
)
from scriptserve.archiver.manifest import MANIFEST_PATH, Manifest, ManifestError, check_model_name


class ArchiveError(Exception):
    """An archive that cannot be written, opened or trusted; the message says why."""


class ArchiveFormat(str, Enum):
    DEFAULT = "default"
    ZIP_STORE = "zip-store"
    TGZ = "tgz"
    NO_ARCHIVE = "no-archive"

    @property
    def extension(self) -> str:
        return {"default": ".mar", "zip-store": ".mar", "tgz": ".tar.gz", "no-archive": ""}[
            self.value
        ]


# What torch-model-archiver leaves out when packing directories.
_EXCLUDED_DIRS = {"__MACOSX", "__pycache__"}
_EXCLUDED_SUFFIXES = (".pyc", ".mar")
_EXCLUDED_FILES = {".DS_Store"}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _excluded(rel: Path) -> bool:
    if rel.name in _EXCLUDED_FILES or rel.name.endswith(_EXCLUDED_SUFFIXES):
        return True
    return any(p in _EXCLUDED_DIRS or p.startswith(".") for p in rel.parts[:-1])


def collect_files(paths: list[Path]) -> dict[str, Path]:
    """Map archive names to sources: files by basename, a directory's contents at the root."""
    files: dict[str, Path] = {}

    def add(name: str, src: Path) -> None:
        if name in files and files[name].resolve() != src.resolve():
            raise ArchiveError(f"two files would both be stored as {name!r}; rename one")
        files[name] = src

    for path in paths:
        if path.is_dir():
            for src in sorted(path.rglob("*")):
                rel = src.relative_to(path)
                if src.is_file() and not src.is_symlink() and not _excluded(rel):
                    add(rel.as_posix(), src)
        elif path.is_file():
            add(path.name, path)
        else:
            raise ArchiveError(f"file not found: {path}")
    return files


@dataclass
class ArchiveSpec:
    """What goes into an archive: the manifest and the files by their name in the archive."""

    manifest: Manifest
    files: dict[str, Path] = field(default_factory=dict)


def _hashes(files: Mapping[str, Path]) -> dict[str, str]:
    return {name: sha256_file(src) for name, src in files.items()}


def archive_path(export_path: Path, model_name: str, fmt: ArchiveFormat) -> Path:
    return export_path / f"{model_name}{fmt.extension}"


def build_archive(
    spec: ArchiveSpec,
    export_path: Path,
    fmt: ArchiveFormat = ArchiveFormat.DEFAULT,
    force: bool = False,
) -> Path:
    """Write the archive and return its path. The manifest's file hashes are filled in here."""
    name = check_model_name(spec.manifest.model.model_name)
    for arcname in spec.files:
        if check_entry_name(arcname) != arcname or arcname == MANIFEST_PATH:
            raise ArchiveError(f"invalid file name in archive: {arcname!r}")
    manifest = spec.manifest
    if manifest.scriptserve is not None:
        manifest = manifest.with_scriptserve(
            replace(manifest.scriptserve, files=_hashes(spec.files))
        )
    export_path.mkdir(parents=True, exist_ok=True)
    target = archive_path(export_path, name, fmt)
    if target.exists() and not force:
        raise ArchiveError(f"{target} already exists; use -f/--force to overwrite it")
    manifest_bytes = manifest.to_json().encode()
    # Write next to the target, then rename: a crash never leaves a half-written archive.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=export_path))
    try:
        staged = tmp / target.name
        if fmt is ArchiveFormat.NO_ARCHIVE:
            _write_directory(staged, manifest_bytes, spec.files)
        elif fmt is ArchiveFormat.TGZ:
            _write_tgz(staged, name, manifest_bytes, spec.files)
        else:
            compression = (
                zipfile.ZIP_STORED if fmt is ArchiveFormat.ZIP_STORE else zipfile.ZIP_DEFLATED
            )
            _write_zip(staged, compression, manifest_bytes, spec.files)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        os.replace(staged, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_zip(target: Path, compression: int, manifest: bytes, files: Mapping[str, Path]) -> None:
    with zipfile.ZipFile(target, "w", compression=compression) as zf:
        zf.writestr(MANIFEST_PATH, manifest)
        for arcname, src in sorted(files.items()):
            zf.write(src, arcname)


def _write_tgz(target: Path, name: str, manifest: bytes, files: Mapping[str, Path]) -> None:
    with tarfile.open(target, "w:gz") as tf:
        info = tarfile.TarInfo(f"{name}/{MANIFEST_PATH}")
        info.size = len(manifest)
        info.mode = 0o644
        tf.addfile(info, io.BytesIO(manifest))
        for arcname, src in sorted(files.items()):
            tf.add(src, f"{name}/{arcname}", recursive=False)


def _write_directory(target: Path, manifest: bytes, files: Mapping[str, Path]) -> None:
    (target / "MAR-INF").mkdir(parents=True)
    (target / MANIFEST_PATH).write_bytes(manifest)
    for arcname, src in files.items():
        dst = target / arcname
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)


def detect_format(path: Path) -> ArchiveFormat:
    if path.is_dir():
        return ArchiveFormat.NO_ARCHIVE
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
        stored = all(i.compress_type == zipfile.ZIP_STORED for i in infos)
        return ArchiveFormat.ZIP_STORE if stored else ArchiveFormat.DEFAULT
    try:
        with tarfile.open(path, "r:*"):
            return ArchiveFormat.TGZ
    except (tarfile.TarError, OSError):
        raise ArchiveError(
            f"{path.name} is not a model archive (zip, tar.gz or directory)"
        ) from None


def _manifest_root(extracted: Path) -> Path:
    """The folder holding MAR-INF: the root, or the single top folder of a tgz archive."""
    if (extracted / MANIFEST_PATH).is_file():
        return extracted
    children = [c for c in extracted.iterdir()]
    if len(children) == 1 and (children[0] / MANIFEST_PATH).is_file():
        return children[0]
    raise ArchiveError(f"archive has no {MANIFEST_PATH}")


def list_files(root: Path) -> dict[str, Path]:
    """Every regular file under `root` except the manifest, by its archive name."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise ArchiveError(f"archive file {path.relative_to(root).as_posix()!r} is a link")
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST_PATH:
                found[rel] = path
    return found


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of checking every file against the manifest's hashes."""

    changed: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    unverifiable: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.changed or self.missing or self.extra or self.unverifiable)

    def reason(self) -> str:
        if self.unverifiable:
            return self.unverifiable
        parts = []
        for label, names in (
            ("changed", self.changed),
            ("missing", self.missing),
            ("not in manifest", self.extra),
        ):
            if names:
                parts.append(f"{label}: {', '.join(names)}")
        return "; ".join(parts) or "all files match their SHA-256"


def check_files(root: Path, manifest: Manifest) -> VerifyReport:
    if manifest.scriptserve is None:
        return VerifyReport(
            unverifiable="the manifest has no scriptserve section with file hashes "
            "(made by torch-model-archiver?); rebuild it with model-archiver to verify it"
        )
    expected = manifest.scriptserve.files
    present = list_files(root)
    changed = tuple(
        n for n in sorted(expected) if n in present and sha256_file(present[n]) != expected[n]
    )
    missing = tuple(n for n in sorted(expected) if n not in present)
    extra = tuple(n for n in sorted(present) if n not in expected)
    return VerifyReport(changed, missing, extra)


class ArchiveReader:
    """An archive opened for use: `root` holds its files, `manifest` its parsed manifest.

    Zip and tar archives are unpacked safely into a fresh temporary directory that is removed on
    `close()`; a `no-archive` directory is used in place.
    """

    def __init__(
        self,
        source: Path,
        limits: ExtractionLimits | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.source = source
        self.format = detect_format(source)
        self._tmp: Path | None = None
        if self.format is ArchiveFormat.NO_ARCHIVE:
            self.root = source.resolve()
            list_files(self.root)  # refuses links: a directory is trusted no more than a zip
        else:
            self._tmp = Path(tempfile.mkdtemp(prefix="scriptserve-", dir=workdir))
            try:
                safe_extract(source, self._tmp, limits)
                self.root = _manifest_root(self._tmp)
            except BaseException:
                self.close()
                raise
        try:
            manifest_file = self.root / MANIFEST_PATH
            if not manifest_file.is_file():
                raise ArchiveError(f"archive has no {MANIFEST_PATH}")
            self.manifest = Manifest.from_json(manifest_file.read_bytes())
        except BaseException:
            self.close()
            raise

    def verify(self) -> VerifyReport:
        return check_files(self.root, self.manifest)

    def path(self, name: str) -> Path:
        """The extracted file `name`, refusing names that leave the archive."""
        return self.root / check_entry_name(name)

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# What zipfile, tarfile and their decompressors raise on damaged or truncated data.
_CORRUPT = (zipfile.BadZipFile, tarfile.TarError, zlib.error, EOFError, gzip.BadGzipFile)


def open_archive(
    path: Path,
    limits: ExtractionLimits | None = None,
    verify: bool = True,
    workdir: Path | None = None,
) -> ArchiveReader:
    """Open an archive; with `verify`, refuse one whose files do not match its recorded hashes.

    Archives without recorded hashes (made by TorchServe) open unverified.
    """
    if not path.exists():
        raise ArchiveError(f"archive not found: {path}")
    try:
        reader = ArchiveReader(path, limits, workdir)
    except (UnsafeArchiveError, ManifestError) as exc:
        raise ArchiveError(f"{path.name}: {exc}") from None
    except _CORRUPT as exc:
        raise ArchiveError(
            f"{path.name}: the archive is corrupt ({exc}); rebuild or download it again"
        ) from None
    if verify and reader.manifest.scriptserve is not None:
        report = reader.verify()
        if not report.ok:
            reader.close()
            raise ArchiveError(f"{path.name} failed verification: {report.reason()}")
    return reader


def verify_archive(path: Path, limits: ExtractionLimits | None = None) -> VerifyReport:
    """Recompute every file's hash; report changed, missing and extra files by name."""
    with open_archive(path, limits, verify=False) as reader:
        return reader.verify()


def iter_archive_files(reader: ArchiveReader) -> Iterator[tuple[str, int, str]]:
    """(name, size, sha256) of every file in an opened archive, the manifest included."""
    yield (
        MANIFEST_PATH,
        (reader.root / MANIFEST_PATH).stat().st_size,
        sha256_file(reader.root / MANIFEST_PATH),
    )
    for name, path in list_files(reader.root).items():
        yield name, path.stat().st_size, sha256_file(path)
