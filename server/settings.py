"""One typed settings tree: defaults < YAML file < `SCRIPTSERVE_*` environment < command line.

Read once in `main()` and passed down; nothing reads the environment at import time.

    settings = load_settings(config_file=Path("serve.yaml"), overrides={"queue_size": 64})
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from scriptserve.server.models.memory import parse_budget
from scriptserve.server.models.model_settings import WARMUP_RUNS, ModelSettings
from scriptserve.server.settings_sources import (
    SettingsError,
    TorchServeConfigSource,
    YamlFileSource,
    one_line,
)

__all__ = [
    "FlagAliases",
    "ModelSettings",  # re-exported while callers import it from here; its module is its home
    "ServerSettings",
    "SettingsError",
    "load_settings",
    "parse_address",
]


OBJECT_STORE_SCHEMES = ("s3", "gs")
"""URL schemes of object storage (server/models/object_store.py)."""


class FlagAliases:
    """Other spellings of a setting's `scriptserve serve` flag, beside `--its-name`:

    workers_per_model: Annotated[int | None, FlagAliases("--workers")] = None
    """

    def __init__(self, *flags: str) -> None:
        self.flags = flags


def parse_address(value: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {value!r} must look like HOST:PORT, e.g. 127.0.0.1:8080")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"address {value!r}: port must be 0..65535")
    return host.strip("[]"), int(port)


class ServerSettings(BaseSettings):
    """Everything the serving process can be told. Each field is a YAML key, a `SCRIPTSERVE_*`
    variable and a `scriptserve serve --flag` (server/cli.py makes the flags from these fields:
    the name in kebab case, the docstring as help); secrets have no flag."""

    model_config = SettingsConfigDict(
        env_prefix="SCRIPTSERVE_", extra="forbid", use_attribute_docstrings=True
    )

    config_file: Annotated[Path | None, FlagAliases("--config")] = None
    """YAML file with any of these settings (lowest precedence after the defaults)."""

    model_store: Path = Path("model_store")
    """Directory the server loads archives from; registration by file name looks here. A bucket
    prefix (`s3://bucket/models`, `gs://...`) is downloaded at start into `model_store_cache`,
    which is then this directory."""
    model_store_url: str | None = None
    """The bucket prefix `model_store` was given as; None for a local store."""
    model_store_cache: Path | None = None
    """Where the archives of a bucket model store are downloaded; default a directory of the
    system's temporary directory named after the URL."""
    s3_endpoint_url: str | None = None
    """An S3-compatible store's endpoint (MinIO, Ceph, ...); unset: AWS_ENDPOINT_URL, else
    AWS's own."""
    quantize_cache_dir: Path | None = None
    """Where models converted to int8 at load are kept, by source hash (default
    `<model_store>/.cache/int8`), so a restart does not convert them again."""
    models: list[str] = Field(default_factory=lambda: ["all"])
    """Models to load at start: `all` (every archive in the store), `NAME=FILE`, or `FILE`."""

    inference_address: str = "127.0.0.1:8080"
    """HOST:PORT of the inference API: TorchServe's and OIP v2 REST routes, health probes."""
    management_address: str = "127.0.0.1:8081"
    """HOST:PORT of the management API (REST): register, scale, describe, unregister."""
    metrics_address: str = "127.0.0.1:8082"
    """HOST:PORT of the Prometheus metrics endpoint."""
    grpc_inference_address: str = "127.0.0.1:7070"
    """HOST:PORT of the gRPC inference services (OIP v2 and TorchServe's), health and
    reflection."""
    grpc_management_address: str = "127.0.0.1:7071"
    """HOST:PORT of TorchServe's gRPC management service."""
    grpc_max_message_bytes: int = Field(default=64 << 20, ge=1024)
    """Largest gRPC message accepted or sent; larger ones get RESOURCE_EXHAUSTED."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` uses every visible GPU (one worker each) when CUDA is available, else the CPU."""
    intra_op_threads: int = Field(default=1, ge=1)
    """Threads each worker's model call may use; workers x this stays within the cores."""
    tensorrt_cache_dir: Path | None = None
    """Where ONNX models on GPUs keep the engines TensorRT builds for them (one folder per model
    version, reused across restarts). Set, ONNX Runtime's TensorRT provider runs them ahead of
    its CUDA provider wherever TensorRT is installed (a model's config opts out with
    `tensorrt: false`); unset, TensorRT is not used."""
    workers_per_model: Annotated[int | None, FlagAliases("--workers")] = Field(default=None, ge=1)
    """Default workers per model: cores / intra-op threads on CPU, one per GPU."""

    gil_switch_interval_ms: float = Field(default=1.0, gt=0)
    """How long a thread may hold the GIL while another waits for it (Python's default is 5 ms).
    A worker whose model call has finished waits this long, at most, for the event loop."""
    gc_young_threshold: int = Field(default=20_000, ge=700)
    """Allocations between two collections of the youngest generation (Python's default is 700;
    the older generations are collected 20 times less often each). A request allocates a few
    hundred objects that all die young: with the default, the collector runs every few
    requests and costs scenario A about a tenth of its throughput on this project's machine."""
    max_batch_size: int = Field(default=32, ge=1)
    """Most requests one model call takes, unless a model's config (`batchSize`) or its
    registration says otherwise."""
    max_batch_delay_ms: Annotated[float, FlagAliases("--max-batch-delay")] = Field(
        default=0.0, ge=0
    )
    """How long a partial batch may wait for more requests; 0 never waits."""
    queue_size: int = Field(default=1000, ge=1)
    """Requests waiting per model version before new ones get 503 + Retry-After."""
    response_timeout_s: Annotated[float, FlagAliases("--response-timeout")] = Field(
        default=120.0, gt=0
    )
    """Deadline of one request from arrival to answer; clients may only shorten it. A streamed
    answer's last part must come within it too."""
    stream_max_unread_parts: int = Field(default=256, ge=1)
    """Parts of a streamed answer that may wait for a slow client; one more ends the stream
    (429 / RESOURCE_EXHAUSTED), so no client makes the server buffer without bound."""
    worker_mode: Literal["thread", "process"] = "thread"
    """Default worker kind: `thread` (fastest, shared memory) or `process` (a child process per
    worker, fed through shared memory: a crash, OOM kill or hang takes down one worker, which
    is replaced). A model's config (`workerMode`) or its registration may choose otherwise."""
    workflow_store: Path | None = None
    """Where `POST /workflows?url=NAME.war` finds workflow archives (TorchServe's
    workflow_store); default: the model store."""
    memory_budget: str | None = None
    """The memory the server may hold, models included: bytes or a size (`2GiB`, `512MB`) or a
    share of its cgroup's limit or the machine's memory (`60%`). A load that would pass it
    first unloads the least recently used idle models (docs/many-models.md); unset: no budget."""
    lazy_load: bool = False
    """Register every model without loading it: each loads on its first request (a model's
    config or registration may say `load: eager`)."""
    warmup: bool = True
    """Have each worker run its archive's sample input before the model reports ready (every
    model: `--no-warmup` turns warm-up off whatever a model's config says)."""
    warmup_runs: int = Field(default=WARMUP_RUNS, ge=0)
    """Times each worker runs the sample input, unless a model's config (`warmupRuns`) says
    otherwise; 0 = none. Two, because TorchScript's profiling executor records the first call
    and optimises the graph on the second."""
    worker_restart_backoff_s: float = Field(default=1.0, ge=0)
    """First delay before a dead process worker (or a stuck thread worker whose replacement could
    not load) is replaced again; it doubles on each failure in a row."""
    worker_restart_backoff_max_s: float = Field(default=30.0, ge=0)
    """Longest delay before a dead process worker is replaced."""
    worker_max_restarts: int = Field(default=5, ge=0)
    """Worker crashes (or hangs) a model may have within `worker_restart_window_s`; one more and
    the model is marked FAILED instead of restarting again."""
    worker_restart_window_s: float = Field(default=300.0, gt=0)
    """Seconds over which `worker_max_restarts` counts a model's worker crashes."""
    worker_stop_grace_s: float = Field(default=5.0, ge=0)
    """How long a stopping process worker may take to exit before it is killed (SIGKILL)."""
    max_abandoned_threads: int = Field(default=4, ge=0)
    """Thread workers stuck past the response timeout that are replaced (a thread cannot be
    killed); with more than this many still stuck, the model is marked FAILED."""

    enable_model_api: bool = False
    """Allow register / unregister through the management API (TorchServe's enable_model_api)."""
    drain_timeout_s: Annotated[float, FlagAliases("--drain-timeout")] = Field(default=30.0, ge=0)
    """On SIGTERM, how long in-flight requests may take to finish."""

    # Hostile clients and the drain (docs/security.md, "Connections").
    drain_keepalive_grace_s: float = Field(default=1.0, ge=0)
    """On SIGTERM, how long (within drain_timeout_s) an idle keep-alive HTTP connection is left
    for its client's next request, answered 503 with `Connection: close`, before it is closed
    (closing it at once races with a request already on its way)."""
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    """Time for a request line and headers to arrive: from connection open for a new
    connection, from the first byte of the head on a keep-alive one (nginx's
    client_header_timeout); then 408, or a close when nothing was sent."""
    http_keepalive_timeout_s: float = Field(default=5.0, gt=0)
    """How long a keep-alive connection may wait idle for its next request before the server
    closes it (uvicorn's default, 5 s). Behind a load balancer that keeps idle connections
    longer (AWS ALB: 60 s), set it above the balancer's: else a request the balancer sends on a
    connection the server is closing fails (a 502 at the balancer)."""
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    """Longest pause between two reads of a request body (nginx's client_body_timeout); then
    408 and the connection closes."""
    http_send_timeout_s: float = Field(default=60.0, gt=0)
    """Longest time a client may leave an answer's bytes unread while the server has more to
    write (nginx's send_timeout); then the connection closes (a stalled stream ends)."""
    http_max_header_bytes: int = Field(default=61440, ge=1024)
    """Largest request line plus headers (Envoy's max_request_headers_kb, 60 KiB); larger: 431
    and the connection closes without reading the rest."""
    http_max_connections: int = Field(default=1024, ge=1)
    """Open HTTP connections across the three HTTP APIs; at the limit a new one closes the
    longest-idle connection, or is answered 503 when none is idle. Lowered to what the
    open-file limit allows."""
    grpc_max_concurrent_streams: int = Field(default=1024, ge=1)
    """Calls one gRPC connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS);
    clients queue the calls beyond it. Above a model's default queue, so one multiplexing client
    can still fill it; Envoy recommends 100 at an edge facing the internet."""
    grpc_keepalive_time_s: float = Field(default=7200.0, gt=0)
    """Idle time after which the server pings a gRPC client to check it is still there."""
    grpc_keepalive_timeout_s: float = Field(default=20.0, gt=0)
    """How long that ping may go unanswered before the connection is closed."""
    grpc_keepalive_min_ping_interval_s: float = Field(default=300.0, ge=0)
    """Shortest interval between a client's pings when no data flows; a faster ping is a strike."""
    grpc_keepalive_max_ping_strikes: int = Field(default=2, ge=0)
    """Strikes before the server closes the connection (GOAWAY `too_many_pings`); 0 = never."""
    grpc_keepalive_max_pings_without_data: int = Field(default=2, ge=0)
    """Keepalive pings the server sends while no data flows before it waits for data; 0 = no
    limit."""
    grpc_keepalive_permit_without_calls: bool = False
    """Accept client pings on a connection without calls (else each counts as a strike)."""
    grpc_max_connection_idle_s: float = Field(default=300.0, ge=0)
    """A gRPC connection without calls for this long is closed (GOAWAY; clients reconnect on
    their next call); 0 = never."""
    grpc_max_connection_age_s: float = Field(default=0.0, ge=0)
    """A gRPC connection is closed (GOAWAY) after this long, spreading clients over replicas
    behind a connection-level balancer; 0 = never."""
    grpc_max_connection_age_grace_s: float = Field(default=30.0, ge=0)
    """Once a connection reaches its maximum age, how long its open calls may take to finish."""
    docs: bool = True
    """Serve /openapi.json and /docs."""

    management_key: SecretStr | None = None
    """Bearer token the management API (REST and gRPC) requires; generated at start if unset."""
    inference_key: SecretStr | None = None
    """Bearer token the inference API requires; when unset the inference API is open on
    loopback, and a key is generated when it listens beyond loopback."""
    management_key_file: Path | None = None
    """File holding the management key (e.g. a mounted Kubernetes Secret)."""
    inference_key_file: Path | None = None
    """File holding the inference key."""
    key_file: Path | None = Path("key_file.json")
    """Where keys generated at start are written (JSON, mode 0600); unset = never generate."""
    insecure_no_auth: bool = False
    """Turn every token check off, even beyond loopback (behind an authenticating proxy only)."""
    max_request_bytes: int = Field(default=6553500, ge=1024)
    """Largest HTTP request body on every route (TorchServe's max_request_size); larger: 413."""
    max_multipart_files: int = Field(default=16, ge=1)
    """Most files one multipart request may carry."""
    max_multipart_fields: int = Field(default=64, ge=1)
    """Most fields (files included) one multipart request may carry."""
    max_multipart_part_bytes: int = Field(default=1 << 20, ge=1024)
    """Largest non-file multipart field (files are bounded by max_request_bytes)."""
    allowed_urls: list[str] = Field(default_factory=list)
    """Regular expressions an http(s) registration URL must match in full; empty = none."""
    download_max_bytes: int = Field(default=1 << 30, ge=1024)
    """Largest archive a registration may download."""
    download_timeout_s: float = Field(default=60.0, gt=0)
    """Time a registration's download may take, from connect to the last byte."""
    snapshot_mode: Literal["per-replica", "declarative"] = "per-replica"
    """`per-replica`: every management change is recorded in this replica's snapshot file,
    restored at its next start. `declarative`: nothing is recorded or restored; the models come
    only from `models` (the config file or --models)."""
    snapshot_dir: Path | None = None
    """Where the snapshot files are kept, one per replica (`models-<snapshot_id>.json`); default
    <model_store>/.snapshot."""
    snapshot_id: str | None = None
    """This replica's name in its snapshot file; default the host name (on Kubernetes the pod
    name, which a StatefulSet pod keeps across restarts and a Deployment pod does not)."""
    restore_snapshot: Annotated[bool, FlagAliases("--snapshot")] = True
    """Load this replica's last snapshot at start (when --models is left at `all`)."""
    ts_config: Path | None = None
    """A TorchServe config.properties to read settings from (below the YAML file; see
    server/models/torchserve_config.py for the keys it maps)."""
    model_defaults: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    """Per model name and version ("*" = any), TorchServe model-config keys (batchSize,
    maxBatchDelay, minWorkers, maxWorkers, responseTimeout, ...) that the archive's own config
    file overrides: TorchServe's config.properties `models`."""
    default_versions: dict[str, str] = Field(default_factory=dict)
    """Model name -> the version that answers when none is named, for models loaded at start
    in several versions (TorchServe's snapshot `defaultVersion`)."""
    service_envelope: Literal["body", "kserve", "kservev2"] = "body"
    """How TorchServe handlers see KServe's protocols (TorchServe's `service_envelope`):
    `kserve`, each v1 instance is one row of the handler's data, as it is (`{"data": ...}`);
    `kservev2`, each v2 request's first input is one row (`{"name", "shape", "datatype",
    "data"}`); `body`, the rows are `{"body": ...}` as for /predictions."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level of the log lines the server writes."""
    metrics_config: Path | None = None
    """TorchServe's metrics.yaml: the `model_metrics` it declares exist for every model's
    handler from the start (`context.metrics.get_metric`), with their types and dimension
    names; config.properties `metrics_config` maps here."""
    log_format: Literal["plain", "json"] = "plain"
    """`json`: every server and worker log line as one JSON object (time, level, logger,
    message, exception), for log pipelines."""
    access_log: str = "off"
    """Where the access log goes (one line per HTTP request and gRPC call,
    server/observability/access_log.py): `off`, `stderr`, `stdout` or a file, appended to."""
    access_log_format: Literal["plain", "json"] = "plain"
    """The access log's lines: plain text, or one JSON object per line."""
    tracing: bool = False
    """OpenTelemetry tracing (server/observability/tracing.py): a span per request with its
    decode, queue, batch and encode steps, exported over OTLP. Needs the `tracing` extra."""
    tracing_endpoint: str | None = None
    """Where spans go: `http://collector:4317` (grpc) or `http://collector:4318/v1/traces`
    (http/protobuf). Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT,
    else the protocol's localhost default."""
    tracing_protocol: Literal["grpc", "http/protobuf"] | None = None
    """OTLP over gRPC or HTTP. Unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or
    OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf."""
    tracing_sampling_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """The share of traces started here that are sampled (a client's sampled flag is followed).
    Unset: OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, else every trace."""
    tracing_service_name: str | None = None
    """The service.name of the spans. Unset: OTEL_SERVICE_NAME, else `scriptserve`."""

    @field_validator(
        "inference_address",
        "management_address",
        "metrics_address",
        "grpc_inference_address",
        "grpc_management_address",
    )
    @classmethod
    def _check_address(cls, value: str) -> str:
        parse_address(value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _bucket_model_store(cls, data: Any) -> Any:
        """A bucket prefix given as `model_store` becomes `model_store_url`, served from a
        local copy."""
        store = data.get("model_store") if isinstance(data, dict) else None
        if isinstance(store, str) and urlsplit(store).scheme.lower() in OBJECT_STORE_SCHEMES:
            digest = hashlib.sha256(store.encode()).hexdigest()[:16]
            default = Path(tempfile.gettempdir()) / "scriptserve-model-store" / digest
            local = data.get("model_store_cache") or default
            data = {**data, "model_store_url": store.rstrip("/"), "model_store": local}
        return data

    @field_validator("memory_budget")
    @classmethod
    def _check_memory_budget(cls, value: str | None) -> str | None:
        if value is not None:
            parse_budget(value)
        return value

    @field_validator("snapshot_id")
    @classmethod
    def _check_snapshot_id(cls, value: str | None) -> str | None:
        # It names a file in a shared directory: no separators, no hidden or relative names.
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", value):
            raise ValueError(
                f"{value!r} must start with a letter or digit and hold only letters,"
                " digits, '.', '_' and '-' (at most 200), e.g. the pod name"
            )
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        assert isinstance(init_settings, InitSettingsSource)
        return (
            init_settings,
            env_settings,
            YamlFileSource(settings_cls, init_settings),
            TorchServeConfigSource(settings_cls, init_settings),
        )

    def model_config_defaults(self, name: str, version: str) -> dict[str, Any]:
        """The `model_defaults` for one model version: its version's keys over "*"'s."""
        versions = self.model_defaults.get(name, {})
        return {**versions.get("*", {}), **versions.get(version, {})}

    def memory_budget_bytes(self) -> int | None:
        """`memory_budget` in bytes (a share read against the memory limit now)."""
        return parse_budget(self.memory_budget) if self.memory_budget is not None else None

    def default_workers(self, gpus: int) -> int:
        if self.workers_per_model is not None:
            return self.workers_per_model
        if gpus:
            return gpus
        return max(1, (os.cpu_count() or 1) // self.intra_op_threads)


def load_settings(config_file: Path | None = None, **overrides: Any) -> ServerSettings:
    """Build the settings tree; `overrides` (the command line) win over everything else.

    The YAML file is `config_file`, else the one `SCRIPTSERVE_CONFIG_FILE` names. Raises
    SettingsError, whose one-line message names every setting that is wrong.
    """
    if config_file is None and os.environ.get("SCRIPTSERVE_CONFIG_FILE"):
        config_file = Path(os.environ["SCRIPTSERVE_CONFIG_FILE"])
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ServerSettings(config_file=config_file, **given)
    except ValidationError as exc:
        raise SettingsError(one_line(exc)) from None
