"""Read a TorchServe `config.properties` into scriptserve settings.

`scriptserve serve --ts-config config.properties` ranks it like a settings file: the YAML file,
`SCRIPTSERVE_*` variables and the command line override it. Keys with a scriptserve equivalent
are mapped (`MAPPED`); every other key is reported once at start as ignored.

As in TorchServe: `model_snapshot` (the JSON of TorchServe's config snapshots, which KServe's
TorchServe runtime writes into its config.properties) names the models to load at start, with
each version's settings, and wins over `load_models`; with `enable_envvars_config=true`, a
`TS_<KEY>` environment variable (`TS_SERVICE_ENVELOPE=kserve`) overrides the file's `<key>`.

    read_torchserve_config(Path("config.properties")).settings
    # {"inference_address": "127.0.0.1:8080", "models": ["squeezenet.mar"], ...}
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("scriptserve.torchserve_config")


class TorchServeConfigError(ValueError):
    """A config.properties value that cannot be used; the message names the key."""


def parse_properties(text: str) -> dict[str, str]:
    """Java `.properties`: `key=value` or `key: value`, `#`/`!` comments, `\\` continuations."""
    props: dict[str, str] = {}
    logical: list[str] = []
    for raw in text.splitlines():
        line = raw.strip() if not logical else raw.lstrip()
        if not logical and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:
            logical.append(line[:-1])
            continue
        logical.append(line)
        entry, logical = "".join(logical), []
        match = re.match(r"((?:\\.|[^=:\s])+)\s*[=:\s]\s*(.*)$", entry)
        if match is None:
            props[entry.strip()] = ""
            continue
        key, value = match.group(1), match.group(2)
        props[key.replace("\\", "")] = value.replace("\\:", ":").replace("\\=", "=").strip()
    if logical:
        props.setdefault("".join(logical).strip(), "")
    return props


def _address(key: str, value: str) -> str:
    """TorchServe's `http(s)://host:port` -> `host:port`."""
    parts = urlsplit(value if "://" in value else f"http://{value}")
    if parts.scheme == "https":
        raise TorchServeConfigError(
            f"{key}={value}: scriptserve serves plain HTTP; terminate TLS in front of it "
            "(an ingress or a proxy) and use http://"
        )
    if parts.scheme not in ("http", "") or not parts.hostname:
        raise TorchServeConfigError(f"{key}={value}: expected http://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        raise TorchServeConfigError(f"{key}={value}: the port must be a number") from None
    if port is None:
        raise TorchServeConfigError(
            f"{key}={value}: the address needs a port, e.g. http://HOST:8080"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


def _bool(key: str, value: str) -> bool:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise TorchServeConfigError(f"{key}={value}: expected true or false")


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise TorchServeConfigError(f"{key}={value}: expected a whole number") from None


def _list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _models(key: str, value: str) -> dict[str, dict[str, dict[str, Any]]]:
    """`models={"name": {"1.0": {"batchSize": 8, ...}}}` as model name -> version -> keys."""
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise TorchServeConfigError(f"{key}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) and all(isinstance(c, dict) for c in v.values()) for v in data.values()
    ):
        raise TorchServeConfigError(
            f'{key}: expected {{"model": {{"version": {{"batchSize": 8, ...}}}}}} (JSON)'
        )
    return data


# TorchServe's snapshot keys of a model version that are not model settings.
_SNAPSHOT_ONLY = ("marName", "defaultVersion")
SERVICE_ENVELOPES = ("body", "kserve", "kservev2")


def _is_dict(value: object) -> bool:
    return isinstance(value, dict)


def _snapshot(key: str, value: str) -> dict[str, Any]:
    """`model_snapshot={"models": {"mnist": {"1.0": {"marName": "mnist.mar", "batchSize": 2,
    ...}}}}` as the models to load (`models`), their settings (`model_defaults`) and default
    versions (`default_versions`)."""
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise TorchServeConfigError(f"{key}: not valid JSON ({exc})") from None
    shape = f'{key}: expected {{"models": {{"model": {{"version": {{"marName": "m.mar", ...}}}}}}}}'
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise TorchServeConfigError(shape)
    sources: list[str] = []
    defaults: dict[str, dict[str, dict[str, Any]]] = {}
    default_versions: dict[str, str] = {}
    for name, versions in models.items():
        if not isinstance(versions, dict) or not all(map(_is_dict, versions.values())):
            raise TorchServeConfigError(shape)
        for version, config in versions.items():
            mar = config.get("marName")
            if not isinstance(mar, str) or not mar:
                raise TorchServeConfigError(f"{key}: model {name} {version} names no marName")
            sources.append(f"{name}={mar}")
            settings = {k: v for k, v in config.items() if k not in _SNAPSHOT_ONLY}
            defaults.setdefault(name, {})[version] = settings
            if config.get("defaultVersion") is True:
                default_versions[name] = version
    return {"models": sources, "model_defaults": defaults, "default_versions": default_versions}


def _envelope(key: str, value: str) -> str:
    if not value:  # KServe fills `{{.Labels.serviceEnvelope}}` with nothing when there is none
        return "body"
    if value not in SERVICE_ENVELOPES:
        raise TorchServeConfigError(
            f"{key}={value}: scriptserve reads the envelopes {', '.join(SERVICE_ENVELOPES)}"
        )
    return value


@dataclass
class TorchServeConfig:
    """What a config.properties says, as scriptserve settings, and the keys left unused."""

    settings: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


# key -> (setting, convert(key, value))
MAPPED: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "inference_address": ("inference_address", _address),
    "management_address": ("management_address", _address),
    "metrics_address": ("metrics_address", _address),
    "model_store": ("model_store", lambda _k, v: v if "://" in v else Path(v)),
    "load_models": ("models", lambda _k, v: _list(v)),
    "models": ("model_defaults", _models),
    "default_workers_per_model": ("workers_per_model", _int),
    "job_queue_size": ("queue_size", _int),
    "default_response_timeout": ("response_timeout_s", _int),
    "allowed_urls": ("allowed_urls", lambda _k, v: _list(v)),
    "max_request_size": ("max_request_bytes", _int),
    "enable_model_api": ("enable_model_api", _bool),
    "disable_token_authorization": ("insecure_no_auth", _bool),
    "metrics_config": ("metrics_config", lambda _k, v: Path(v)),
    "service_envelope": ("service_envelope", _envelope),
}
# Keys read here beside MAPPED.
_OWN = ("model_snapshot", "enable_envvars_config")
_GRPC = {
    "inference": ("grpc_inference_address", "grpc_inference_port", "7070"),
    "management": ("grpc_management_address", "grpc_management_port", "7071"),
}


def map_properties(props: dict[str, str]) -> TorchServeConfig:
    """The settings the properties map to, and the keys without a scriptserve equivalent."""
    config = TorchServeConfig()
    for key, value in props.items():
        if key in MAPPED:
            setting, parse = MAPPED[key]
            config.settings[setting] = parse(key, value)
        elif key not in _OWN and not any(key in pair[:2] for pair in _GRPC.values()):
            config.ignored.append(key)
    for address_key, port_key, default_port in _GRPC.values():
        if address_key not in props and port_key not in props:
            continue
        host = props.get(address_key, "127.0.0.1").strip("[]")
        port = str(_int(port_key, props.get(port_key, default_port)))
        host = f"[{host}]" if ":" in host else host
        config.settings[address_key] = f"{host}:{port}"
    if "model_snapshot" in props:  # TorchServe restores it instead of loading load_models
        snapshot = _snapshot("model_snapshot", props["model_snapshot"])
        config.settings["models"] = snapshot["models"]
        config.settings["default_versions"] = snapshot["default_versions"]
        config.settings["model_defaults"] = {
            **config.settings.get("model_defaults", {}),
            **snapshot["model_defaults"],
        }
    elif "load_models" not in props:
        # TorchServe loads nothing unless told to; `--models` on the command line still wins.
        config.settings["models"] = []
    return config


def with_environment(props: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """TorchServe's `enable_envvars_config=true`: `TS_<KEY>` overrides the file's `<key>`."""
    if props.get("enable_envvars_config", "").lower() != "true":
        return props
    overrides = {
        name[3:].lower(): value
        for name, value in environ.items()
        if name.startswith("TS_") and len(name) > 3
    }
    return {**props, **overrides}


def read_torchserve_config(
    path: Path, environ: Mapping[str, str] | None = None
) -> TorchServeConfig:
    """Parse and map the file (with `environ`'s TS_* variables when the file enables them);
    raises TorchServeConfigError naming the key at fault."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise TorchServeConfigError(f"TorchServe config {path}: {exc.strerror}") from None
    try:
        return map_properties(with_environment(parse_properties(text), environ or {}))
    except TorchServeConfigError as exc:
        raise TorchServeConfigError(f"TorchServe config {path}: {exc}") from None


def report_torchserve_config(path: Path, environ: Mapping[str, str] | None = None) -> None:
    """Log, on one line, which keys of the file were mapped and which are ignored."""
    config = read_torchserve_config(path, environ)
    log.info(
        "TorchServe config %s: using %s; ignoring %s",
        path,
        ", ".join(sorted(config.settings)) or "nothing",
        ", ".join(sorted(config.ignored)) or "no keys",
    )
    if config.settings.get("insecure_no_auth"):
        log.warning(
            "TorchServe config %s: disable_token_authorization=true turns off every token check",
            path,
        )
