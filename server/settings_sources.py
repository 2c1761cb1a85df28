"""Where settings come from besides the environment and the command line: the YAML file and
TorchServe's config.properties (`ServerSettings.settings_customise_sources` orders them), and
how a settings error reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource


class SettingsError(ValueError):
    """Settings that cannot be used; the message names each bad setting, on one line."""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1})" if mark else exc.problem
    return " ".join(str(exc).split())


class YamlFileSource(PydanticBaseSettingsSource):
    """Values from the YAML file named by the `config_file` init argument (safe_load only)."""

    def __init__(self, settings_cls: type[BaseSettings], init: InitSettingsSource) -> None:
        super().__init__(settings_cls)
        self._path = init.init_kwargs.get("config_file")

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole mapping

    def __call__(self) -> dict[str, Any]:
        if not self._path:
            return {}
        path = Path(self._path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise SettingsError(f"config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise SettingsError(f"config file {path}: {_yaml_problem(exc)}") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise SettingsError(f"config file {path} must hold a mapping of settings")
        return {str(k).replace("-", "_"): v for k, v in data.items()}


class TorchServeConfigSource(PydanticBaseSettingsSource):
    """Values from the TorchServe config.properties named by the `ts_config` init argument."""

    def __init__(self, settings_cls: type[BaseSettings], init: InitSettingsSource) -> None:
        super().__init__(settings_cls)
        self._path = init.init_kwargs.get("ts_config")

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole mapping

    def __call__(self) -> dict[str, Any]:
        if not self._path:
            return {}
        from scriptserve.server.models.torchserve_config import (
            TorchServeConfigError,
            read_torchserve_config,
        )

        try:
            return read_torchserve_config(Path(self._path), os.environ).settings
        except TorchServeConfigError as exc:
            raise SettingsError(str(exc)) from None


def one_line(exc: ValidationError) -> str:
    """A validation error as one line naming every setting that is wrong."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            problem = "unknown setting"
        else:
            problem = error["msg"].removeprefix("Value error, ")
            if error["type"] != "value_error":
                problem += f" (got {error['input']!r})"
        problems.append(f"{where}: {problem}" if where else problem)
    return "; ".join(problems)
