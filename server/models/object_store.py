"""Archives in object storage: `s3://bucket/key` and `gs://bucket/key`, through fsspec (s3fs,
gcsfs: the `object-store` extra).

Two uses: registering one archive from an allowed URL (security.fetch_archive checks it first),
and a model store that is a bucket prefix (`--model-store s3://bucket/models`), whose archives
are downloaded into a local directory at start and served from there.

Credentials come from the standard sources of each store and are never read or logged here:
for S3 the AWS variables, shared config files, web identity (IRSA) or instance metadata, and
`AWS_ENDPOINT_URL` (or `s3_endpoint_url`) for S3-compatible stores; for GCS
`GOOGLE_APPLICATION_CREDENTIALS` or the metadata server. A download is bounded like an http(s)
one: `download_max_bytes` (checked on the object's listed size before reading, and while
reading) and `download_timeout_s` for the whole transfer.

    path = await download("s3://models/prod/mnist.mar", Path("model_store"), settings)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from scriptserve.server.errors import InvalidInput, PayloadTooLarge, ServingError
from scriptserve.server.settings import OBJECT_STORE_SCHEMES, ServerSettings

log = logging.getLogger("scriptserve.object_store")

ARCHIVE_SUFFIXES = (".mar", ".tar.gz", ".tgz")
_CHUNK = 1 << 20
_PACKAGES = {"s3": "s3fs", "gs": "gcsfs"}


class ObjectStoreUnavailable(InvalidInput):
    """The URL's store needs a package that is not installed."""


def is_object_url(source: str) -> bool:
    return urlsplit(source).scheme.lower() in OBJECT_STORE_SCHEMES


def filesystem(scheme: str, settings: ServerSettings) -> Any:
    """The fsspec filesystem of `scheme`, with the standard credential chain."""
    try:
        import fsspec
    except ImportError:
        raise ObjectStoreUnavailable(
            "object storage needs fsspec: pip install 'scriptserve[object-store]'"
        ) from None
    options: dict[str, Any] = {"skip_instance_cache": True}
    if scheme == "s3" and settings.s3_endpoint_url:
        options["endpoint_url"] = settings.s3_endpoint_url
    try:
        return fsspec.filesystem(scheme, **options)
    except ImportError:
        raise ObjectStoreUnavailable(
            f"{scheme}:// URLs need {_PACKAGES[scheme]}: pip install 'scriptserve[object-store]'"
        ) from None


def _failure(what: str, exc: BaseException) -> ServingError:
    """A clear error for a failed store call, without the library's text (it may name
    endpoints, request ids or signed headers)."""
    if isinstance(exc, FileNotFoundError):
        return InvalidInput(f"{what} failed: no such object (check the bucket and key)")
    if isinstance(exc, PermissionError):
        return InvalidInput(f"{what} failed: access denied (check the credentials' permissions)")
    return InvalidInput(f"{what} failed: {type(exc).__name__}")


class _Transfer:
    """One object copied to a local file in a worker thread, bounded in size; `cancel` stops
    it at the next chunk."""

    def __init__(self, fs: Any, path: str, part: Path, limit: int) -> None:
        self.fs, self.path, self.part, self.limit = fs, path, part, limit
        self.cancelled = threading.Event()

    def run(self) -> int:
        """Copy, or raise; the partial file is removed on any failure or cancellation, here,
        since this thread may outlive the caller's wait."""
        try:
            return self._copy()
        except BaseException:
            self.part.unlink(missing_ok=True)
            raise

    def _copy(self) -> int:
        size = self.fs.size(self.path)
        if size is not None and size > self.limit:
            raise PayloadTooLarge(f"the archive is larger than {self.limit} bytes")
        copied = 0
        source = self.fs.open(self.path, "rb", block_size=_CHUNK)
        with source, self.part.open("wb") as out:
            while not self.cancelled.is_set():
                chunk = source.read(_CHUNK)
                if not chunk:
                    return copied
                copied += len(chunk)
                if copied > self.limit:
                    raise PayloadTooLarge(f"the archive is larger than {self.limit} bytes")
                out.write(chunk)
        raise TimeoutError("the transfer was cancelled")


async def copy_object(url: str, target: Path, settings: ServerSettings) -> int:
    """Copy the object at `url` to `target` (through a temporary file beside it, renamed when
    complete); returns its size. Errors are ServingErrors that say what to fix."""
    parts = urlsplit(url)
    fs = filesystem(parts.scheme.lower(), settings)
    part = target.parent / f".download-{secrets.token_hex(8)}.part"
    transfer = _Transfer(fs, f"{parts.netloc}{parts.path}", part, settings.download_max_bytes)
    try:
        size = await asyncio.wait_for(asyncio.to_thread(transfer.run), settings.download_timeout_s)
        os.replace(part, target)
    except asyncio.TimeoutError:
        transfer.cancelled.set()  # the transfer removes its partial file when it stops
        raise InvalidInput(
            f"downloading the archive took longer than {settings.download_timeout_s:g} s"
        ) from None
    except ServingError:
        raise
    except Exception as exc:
        raise _failure("downloading the archive", exc) from None
    return int(size)


def _version(entry: dict[str, Any]) -> str:
    """What changes when the object does: its ETag (S3), generation or hash (GCS), else size."""
    for key in ("ETag", "etag", "generation", "md5Hash"):
        if entry.get(key):
            return f"{key}:{entry[key]}"
    return f"size:{entry.get('size')}"


async def sync_store(url: str, local: Path, settings: ServerSettings) -> list[Path]:
    """Download the archives directly under the prefix `url` into `local`, keeping those
    already there whose object has not changed since (`.versions.json` records each one's
    ETag); returns the local files. Run at start, before serving."""
    parts = urlsplit(url)
    fs = filesystem(parts.scheme.lower(), settings)
    prefix = f"{parts.netloc}{parts.path}".rstrip("/")
    started = time.monotonic()
    try:
        listed = await asyncio.to_thread(fs.ls, prefix, detail=True)
    except Exception as exc:
        raise _failure(f"listing the model store {url}", exc) from None
    local.mkdir(parents=True, exist_ok=True)
    record = local / ".versions.json"
    try:
        known: dict[str, str] = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    found, copied = [], 0
    for entry in sorted(listed, key=lambda e: str(e["name"])):
        name = str(entry["name"]).rsplit("/", 1)[-1]
        if entry.get("type") != "file" or not name.endswith(ARCHIVE_SUFFIXES):
            continue
        target, version = local / name, _version(entry)
        if not (target.is_file() and known.get(name) == version):
            known.pop(name, None)
            await copy_object(f"{parts.scheme}://{entry['name']}", target, settings)
            known[name] = version
            copied += 1
        found.append(target)
    record.write_text(json.dumps(known))
    log.info(
        "model store %s: %d archive(s) in %s, %d copied (%.1f s)",
        url,
        len(found),
        local,
        copied,
        time.monotonic() - started,
    )
    return found
