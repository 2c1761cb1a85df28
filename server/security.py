"""Access keys, the registration URL allow-list, and archive downloads.

Two bearer tokens guard the APIs: the management key (always required by the management API)
and the inference key (required by the inference API when one is configured, and always when
the inference API listens beyond loopback). Keys come from settings, from key files, or are
generated at start into `key_file` (mode 0600); only the file's path is ever logged.

    keys = resolve_keys(settings)
    error = keys.check("management", "Bearer <token>")   # None when allowed
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urljoin, urlsplit

from scriptserve.server.codec.header_values import non_negative_int
from scriptserve.server.errors import (
    Conflict,
    InvalidInput,
    PayloadTooLarge,
    PermissionDenied,
    ServingError,
    Unauthenticated,
)
from scriptserve.server.models.object_store import copy_object, is_object_url
from scriptserve.server.settings import OBJECT_STORE_SCHEMES, ServerSettings, parse_address

log = logging.getLogger("scriptserve.security")

Api = Literal["management", "inference"]
CHALLENGE = {"WWW-Authenticate": "Bearer"}
_PREFIX = "bearer "
MAX_REDIRECTS = 5
ARCHIVE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*(\.mar|\.tar\.gz|\.tgz)")


class SecurityConfigError(ValueError):
    """The access settings cannot be used; the message says what to change (one line)."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; anything else (0.0.0.0 included) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class AccessKeys:
    """The keys each API accepts; `enforced` is False only with insecure_no_auth."""

    management: str | None
    inference: str | None
    enforced: bool = True

    def required(self, api: Api) -> bool:
        if not self.enforced:
            return False
        return api == "management" or self.inference is not None

    def check(self, api: Api, authorization: str | None) -> ServingError | None:
        """The error for this Authorization header on `api`, or None when it may pass.

        Both keys are compared in constant time whatever the header holds, so the answer's
        timing says nothing about either key.
        """
        if not self.required(api):
            return None
        token = ""
        if authorization is not None and authorization[:7].lower() == _PREFIX:
            token = authorization[7:].strip()
        given = token.encode()
        is_mgmt = self.management is not None and secrets.compare_digest(
            given, self.management.encode()
        )
        is_inf = self.inference is not None and secrets.compare_digest(
            given, self.inference.encode()
        )
        own, other = (is_mgmt, is_inf) if api == "management" else (is_inf, is_mgmt)
        if own and token:
            return None
        if other and token:
            return PermissionDenied(
                f"this key is not valid for the {api} API; send the {api} key", CHALLENGE
            )
        if not token:
            return Unauthenticated(
                f"the {api} API needs a key: send 'Authorization: Bearer <key>'", CHALLENGE
            )
        return Unauthenticated(f"the key sent is not valid for the {api} API", CHALLENGE)


def _read_key(path: Path, what: str) -> str:
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read {what} file {path}: {exc.strerror}") from None
    if not key:
        raise SecurityConfigError(f"{what} file {path} is empty")
    return key


def _write_key_file(path: Path, keys: dict[str, str]) -> None:
    """Write generated keys as JSON readable by the owner only (0600), atomically."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(keys, out)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SecurityConfigError(
            f"cannot write generated keys to {path}: {exc.strerror}; set key_file to a "
            "writable path, or give management_key / inference_key"
        ) from None


def _given(secret: object, file: Path | None, what: str) -> str | None:
    value = getattr(secret, "get_secret_value", lambda: None)()
    if value:
        return str(value)
    if file is not None:
        return _read_key(file, what)
    return None


def resolve_keys(settings: ServerSettings) -> AccessKeys:
    """The keys the server runs with; generates the missing ones that are needed.

    Raises SecurityConfigError when an API would listen beyond loopback without a key.
    """
    inference_hosts = [
        parse_address(a)[0] for a in (settings.inference_address, settings.grpc_inference_address)
    ]
    management_hosts = [
        parse_address(a)[0] for a in (settings.management_address, settings.grpc_management_address)
    ]
    exposed = [h for h in [*inference_hosts, *management_hosts] if not is_loopback(h)]
    if settings.insecure_no_auth:
        log.warning(
            "insecure_no_auth is set: no API checks a key%s",
            f"; listening beyond loopback on {', '.join(sorted(set(exposed)))}" if exposed else "",
        )
        return AccessKeys(None, None, enforced=False)
    management = _given(settings.management_key, settings.management_key_file, "management key")
    inference = _given(settings.inference_key, settings.inference_key_file, "inference key")
    inference_exposed = any(not is_loopback(h) for h in inference_hosts)
    management_exposed = any(not is_loopback(h) for h in management_hosts)
    generated: dict[str, str] = {}
    if management is None:
        if settings.key_file is None and management_exposed:
            raise SecurityConfigError(
                "refusing to listen beyond loopback without a management key: set "
                "management_key, management_key_file or key_file, or pass --insecure-no-auth"
            )
        if settings.key_file is not None:
            management = generated["management"] = secrets.token_urlsafe(32)
    if inference is None and inference_exposed:
        if settings.key_file is None:
            raise SecurityConfigError(
                "refusing to listen beyond loopback without an inference key: set "
                "inference_key, inference_key_file or key_file, or pass --insecure-no-auth"
            )
        inference = generated["inference"] = secrets.token_urlsafe(32)
    if generated:
        assert settings.key_file is not None
        _write_key_file(settings.key_file, generated)
        log.info(
            "generated %s key(s), written to %s (readable by its owner only)",
            " and ".join(sorted(generated)),
            settings.key_file.resolve(),
        )
    if management is None:
        log.warning("no management key and no key_file: the management API refuses every call")
    return AccessKeys(management, inference)


# -- registration from a URL ----------------------------------------------------------------------
def is_url(source: str) -> bool:
    """A registration source with a scheme (`http://…`, `s3://…`, `file://…`), not a store file
    name."""
    return "://" in source or source.lower().startswith(("file:", "http:", "https:"))


def check_url(url: str, allowed: list[str]) -> str:
    """Validate a registration URL before any connection; returns it, or raises.

    Only http(s), s3 and gs, no user info, no `..` (however encoded), no backslashes or control
    characters, and the whole URL must match one of the `allowed` regular expressions.
    """
    if not allowed:
        raise PermissionDenied(
            "registering from a URL is disabled (allowed_urls is empty); put the archive in "
            "the model store and register it by file name"
        )
    if any(ord(c) < 0x21 or c in "\\\x7f" for c in url):
        raise InvalidInput("the url contains whitespace, control characters or backslashes")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise InvalidInput("the url is malformed") from None
    if parts.scheme.lower() not in ("http", "https", *OBJECT_STORE_SCHEMES):
        raise InvalidInput("only http://, https://, s3:// and gs:// URLs may be registered")
    if "@" in parts.netloc or not parts.hostname:
        raise InvalidInput(
            "the url must name a host (a bucket) and carry no user info ('user@host')"
        )
    path = parts.path
    for _ in range(3):  # %252e%252e decodes twice
        path = unquote(path)
    if ".." in path.split("/") or "\\" in path or "%" in unquote(path):
        raise InvalidInput("the url's path must not contain '..' segments or encoded escapes")
    if not any(re.fullmatch(pattern, url) for pattern in allowed):
        raise PermissionDenied("the url does not match any entry of allowed_urls")
    return url


def _archive_name(url: str) -> str:
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    if not ARCHIVE_NAME.fullmatch(name):
        raise InvalidInput(
            "the url must end in an archive file name (letters, digits, '_', '-', '.'; "
            "ending .mar, .tar.gz or .tgz)"
        )
    return name


async def fetch_archive(url: str, settings: ServerSettings) -> Path:
    """Download an allowed archive URL into the model store; returns the file.

    Redirects are followed by hand, each target checked against the allow-list before any
    connection to it; the size and the whole download's time are bounded. `s3://` and `gs://`
    URLs are copied through server/models/object_store.py under the same bounds.
    """
    import httpx

    check_url(url, settings.allowed_urls)
    name = _archive_name(url)
    target = settings.model_store / name
    if target.exists():
        raise Conflict(f"archive {name!r} is already in the model store; register it by name")
    if is_object_url(url):
        settings.model_store.mkdir(parents=True, exist_ok=True)
        size = await copy_object(url, target, settings)
        log.info("downloaded archive %s (%d bytes)", name, size)
        return target
    part = settings.model_store / f".download-{secrets.token_hex(8)}.part"
    limit = settings.download_max_bytes

    async def download() -> None:
        current = url
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                async with client.stream("GET", current) as response:
                    if response.is_redirect:
                        location = response.headers.get("location", "")
                        current = check_url(urljoin(current, location), settings.allowed_urls)
                        continue
                    if response.status_code != 200:
                        raise InvalidInput(
                            f"downloading the archive failed: HTTP {response.status_code}"
                        )
                    declared = non_negative_int(response.headers.get("content-length", ""))
                    if declared is not None and declared > limit:
                        raise PayloadTooLarge(f"the archive is larger than {limit} bytes")
                    size = 0
                    with part.open("wb") as out:
                        async for chunk in response.aiter_bytes():
                            size += len(chunk)
                            if size > limit:
                                raise PayloadTooLarge(f"the archive is larger than {limit} bytes")
                            out.write(chunk)
                    return
        raise InvalidInput(f"the url redirects more than {MAX_REDIRECTS} times")

    settings.model_store.mkdir(parents=True, exist_ok=True)
    try:
        await asyncio.wait_for(download(), settings.download_timeout_s)
        os.replace(part, target)
    except asyncio.TimeoutError:
        raise InvalidInput(
            f"downloading the archive took longer than {settings.download_timeout_s:g} s"
        ) from None
    except httpx.HTTPError as exc:
        raise InvalidInput(f"downloading the archive failed: {type(exc).__name__}") from None
    finally:
        part.unlink(missing_ok=True)
    log.info("downloaded archive %s (%d bytes)", name, target.stat().st_size)
    return target
