"""How one model version is served: batching, workers, timeouts, worker kind and devices.

Four sources, each overriding the one before: the server's settings, the server's
`model_defaults` (TorchServe's config.properties `models`), the archive's model-config YAML
(TorchServe's keys, the aliases below), and the parameters of the registration.

    ModelSettings.resolve(server, {"batchSize": 8, "deviceIds": "0,2"}).batch_size  # 8
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from scriptserve.server.settings import ServerSettings


WARMUP_RUNS = 2
"""Default runs of the sample input per worker: TorchScript's profiling executor records the first
call and optimises the graph on the second."""


class ModelSettingsError(ValueError):
    """Model settings that cannot be used; the one-line message names each key at fault."""


def _keys(name: str, *torchserve: str) -> AliasChoices:
    """A field is read under its own name and under TorchServe's model-config names."""
    return AliasChoices(name, *torchserve)


class ModelSettings(BaseModel):
    """How one model version is served; `resolve` builds it from its four sources."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    batch_size: int = Field(ge=1, validation_alias=_keys("batch_size", "batchSize"))
    """Most requests one model call takes (1 for a handler that cannot batch)."""
    max_batch_delay_ms: float = Field(
        ge=0, validation_alias=_keys("max_batch_delay_ms", "maxBatchDelay")
    )
    """How long a partial batch may wait for more requests; 0 never waits."""
    workers: int = Field(ge=1, validation_alias=_keys("workers", "minWorkers"))
    """Workers started at load."""
    response_timeout_s: float = Field(
        gt=0, validation_alias=_keys("response_timeout_s", "responseTimeout")
    )
    queue_size: int = Field(ge=1, validation_alias=_keys("queue_size", "jobQueueSize"))
    worker_mode: Literal["thread", "process"] = Field(
        default="thread", validation_alias=_keys("worker_mode", "workerMode")
    )
    max_workers: int | None = Field(
        default=None, ge=1, validation_alias=_keys("max_workers", "maxWorkers")
    )
    """The most workers scaling may start; None = no limit."""
    device_type: Literal["cpu", "gpu"] | None = Field(
        default=None, validation_alias=_keys("device_type", "deviceType")
    )
    """None = the server's devices."""
    device_ids: tuple[int, ...] | None = Field(
        default=None, validation_alias=_keys("device_ids", "deviceIds")
    )
    """The GPUs this model may use; None = every visible one."""
    warmup_runs: int = Field(
        default=WARMUP_RUNS, ge=0, validation_alias=_keys("warmup_runs", "warmupRuns")
    )
    """Times each worker runs the archive's sample input before the model reports ready."""
    load: Literal["eager", "lazy"] = "eager"
    """`lazy`: registered without workers, loaded on its first request (and again after being
    unloaded to make room); `eager`: loaded at registration. The server's `--lazy-load` makes
    `lazy` every model's default."""
    evictable: bool = True
    """May be unloaded, when idle, to make room for another model under the memory budget;
    `false` pins it."""

    @field_validator("device_type", mode="before")
    @classmethod
    def _lower_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("device_ids", mode="before")
    @classmethod
    def _split_device_ids(cls, value: Any) -> Any:
        """deviceIds as a YAML list, a comma-separated string ("0,2") or one number."""
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        if isinstance(value, int):
            return [value]
        return value

    @model_validator(mode="after")
    def _max_workers_bounds_workers(self) -> ModelSettings:
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ValueError(
                f"maxWorkers ({self.max_workers}) must be at least minWorkers ({self.workers})"
            )
        return self

    def devices(self, available: list[str]) -> list[str]:
        """The server's devices this model's workers may run on, round-robin."""
        if self.device_type == "cpu":
            return ["cpu"]
        gpus = [d for d in available if d.startswith("cuda")]
        if self.device_ids is not None:
            gpus = [d for d in gpus if int(d.partition(":")[2] or 0) in self.device_ids]
        if self.device_type == "gpu" and not gpus:
            wanted = f" {list(self.device_ids)}" if self.device_ids is not None else ""
            raise ModelSettingsError(
                f"deviceType gpu{wanted} asked for, but no such GPU is visible"
            )
        return gpus or available

    def check_scale(self, workers: int) -> None:
        """Refuse a scale request past maxWorkers, TorchServe's bound on scaling.

        settings.check_scale(4)  # ModelSettingsError when the model's maxWorkers is 3
        """
        if self.max_workers is not None and workers > self.max_workers:
            raise ModelSettingsError(
                f"cannot scale to {workers} workers: the model's maxWorkers is {self.max_workers}"
            )

    @classmethod
    def resolve(
        cls,
        server: ServerSettings,
        archive_config: dict[str, Any],
        overrides: dict[str, Any] | None = None,
        gpus: int = 0,
        batching: bool = True,
        defaults: dict[str, Any] | None = None,
    ) -> ModelSettings:
        """Layer the sources: `server` < `defaults` (TorchServe model-config keys from the
        server's config) < `archive_config` (the archive's model-config file) < `overrides`
        (the registration's, by setting name; None = not given). Other keys of the configs are
        left to the handler, which reads its own. `gpus` counts the visible GPUs; a handler
        that cannot batch (`batching=False`) gets batch size 1; a server with warm-up off
        (`warmup=False`) gets no warm-up runs. Raises ModelSettingsError."""
        values: dict[str, Any] = {
            "batch_size": server.max_batch_size,
            "max_batch_delay_ms": server.max_batch_delay_ms,
            "response_timeout_s": server.response_timeout_s,
            "queue_size": server.queue_size,
            "worker_mode": server.worker_mode,
            "warmup_runs": server.warmup_runs,
            "load": "lazy" if server.lazy_load else "eager",
        }
        given: dict[str, str] = {}  # field -> the key that set it, as its source spelled it
        for config in (defaults or {}, archive_config):
            for key, value in config.items():
                if key in _CONFIG_KEYS:
                    values[_CONFIG_KEYS[key]], given[_CONFIG_KEYS[key]] = value, key
                elif key == "device":
                    values["device_type"], values["device_ids"] = placement(value)
                    given["device_type"] = given["device_ids"] = key
        for key, value in (overrides or {}).items():
            if key not in cls.model_fields:
                raise ModelSettingsError(f"unknown model setting {key!r}")
            if value is not None:
                values[key], given[key] = value, key
        if "workers" not in given:
            # The default worker count depends on the devices, known once they are validated.
            devices_known = cls._validate({**values, "workers": 1}, given)
            values["workers"] = devices_known._default_workers(server, gpus)
        settings = cls._validate(values, given)
        if not server.warmup:  # the server's off switch wins over every model's count
            settings = settings.model_copy(update={"warmup_runs": 0})
        return settings if batching else settings.model_copy(update={"batch_size": 1})

    def _default_workers(self, server: ServerSettings, gpus: int) -> int:
        """Workers when minWorkers is not given: by cores on CPU, one per GPU the model may use."""
        if self.device_type == "cpu":
            return server.default_workers(0)
        if self.device_type == "gpu" and self.device_ids:
            return len(self.device_ids)
        return server.default_workers(gpus)

    @classmethod
    def _validate(cls, values: dict[str, Any], given: dict[str, str]) -> ModelSettings:
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ModelSettingsError(_one_line(exc, given)) from None


# The keys of a model-config file (an archive's, or the server's model_defaults) that set model
# settings: TorchServe's names, and `worker_mode` too. Every other key is the handler's own.
# Registration overrides use the settings' own names instead.
_CONFIG_KEYS: dict[str, str] = {
    key: name
    for name, field in ModelSettings.model_fields.items()
    if isinstance(field.validation_alias, AliasChoices)
    for key in field.validation_alias.choices
    if isinstance(key, str) and key != name
} | {"worker_mode": "worker_mode", "load": "load", "evictable": "evictable"}


def placement(device: Any) -> tuple[str, tuple[int, ...] | None]:
    """A model config's `device` as deviceType and deviceIds: `cpu`; `cuda` (every visible GPU);
    `cuda:1`; `cuda:0,2` (those GPUs, workers round-robin over them)."""
    text = str(device).strip().lower()
    if text == "cpu":
        return "cpu", None
    kind, _, ids = text.partition(":")
    if kind in ("cuda", "gpu"):
        if not ids:
            return "gpu", None
        parts = [p.strip() for p in ids.split(",")]
        if all(p.isdigit() for p in parts):
            return "gpu", tuple(int(p) for p in parts)
    raise ModelSettingsError(
        f"invalid model setting: device {device!r}: use cpu, cuda, cuda:N or cuda:N,M"
    )


def _one_line(exc: ValidationError, given: dict[str, str]) -> str:
    """'invalid model setting: batchSize: batch_size must be ... (got 0)', one clause per error;
    a key spelled otherwise than the setting (TorchServe's names) is named first."""
    problems = []
    for error in exc.errors():
        if error["type"] == "value_error":  # the checks across fields say it all
            problems.append(error["msg"].removeprefix("Value error, "))
            continue
        name = str(error["loc"][0])
        key = given.get(name, name)
        problem = f"{name} {error['msg'].replace('Input should be', 'must be')}"
        problem += f" (got {error['input']!r})"
        problems.append(problem if key == name else f"{key}: {problem}")
    return "invalid model setting: " + "; ".join(problems)
