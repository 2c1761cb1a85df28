"""`ts.context.Context`: what a TorchServe handler is told about its model and its batch.

Per-request state (ids, headers, response status, content type and headers) is reset for each
batch by the adapter; a handler instance serves one batch at a time, as in TorchServe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .metrics import MetricsCache


class RequestProcessor:
    """One request's headers in, its status, content type and headers out."""

    def __init__(self, request_header: Mapping[str, str]) -> None:
        self._request_header = request_header
        self._status_code = 200
        self._reason_phrase: str | None = None
        self._response_header: dict[str, str] = {}

    def get_request_property(self, key: str) -> str | None:
        value = self._request_header.get(key)
        if value is None:
            value = self._request_header.get(key.lower())
        return value

    def get_request_properties(self) -> Mapping[str, str]:
        return self._request_header

    def report_status(self, code: int, reason: str | None = None) -> None:
        self._status_code = code
        self._reason_phrase = reason

    def get_response_status_code(self) -> int:
        return self._status_code

    def get_response_status_phrase(self) -> str | None:
        return self._reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        self._response_header[key] = value

    def get_response_headers(self) -> dict[str, str]:
        return self._response_header

    def get_response_header(self, key: str) -> str | None:
        return self._response_header.get(key)


class Context:
    """TorchServe's Context, with the same constructor and accessors."""

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict[str, Any],
        batch_size: int,
        gpu: int | None,
        mms_version: str,
        limit_max_image_pixels: bool = True,
        metrics: MetricsCache | None = None,
        model_yaml_config: dict[str, Any] | None = None,
    ) -> None:
        self.model_name = model_name
        self.manifest = manifest
        self._system_properties: dict[str, Any] = {
            "model_dir": model_dir,
            "gpu_id": gpu,
            "batch_size": batch_size,
            "server_name": "MMS",
            "server_version": mms_version,
            "limit_max_image_pixels": limit_max_image_pixels,
        }
        self.request_ids: dict[int, str] = {}
        self.request_processor: list[RequestProcessor] = []
        self.tensor_requests: list[bool] = []
        """Per request of the batch: it came with tensors (Open Inference Protocol)."""
        self._metrics = metrics if metrics is not None else MetricsCache(model_name)
        self._limit_max_image_pixels = limit_max_image_pixels
        self.model_yaml_config: dict[str, Any] = model_yaml_config or {}
        self.stopping_criteria: Any = None
        self.cl_socket: Any = None

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    @property
    def metrics(self) -> MetricsCache:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: MetricsCache) -> None:
        self._metrics = metrics

    def get_request_id(self, idx: int = 0) -> str | None:
        return self.request_ids.get(idx)

    def get_request_header(self, idx: int, key: str) -> str | None:
        return self.request_processor[idx].get_request_property(key)

    def get_all_request_header(self, idx: int) -> Mapping[str, str]:
        return self.request_processor[idx].get_request_properties()

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.set_response_header(idx, "content-type", value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self.get_response_headers(idx).get("content-type")

    def get_response_status(self, idx: int) -> tuple[int, str | None]:
        processor = self.request_processor[idx]
        return processor.get_response_status_code(), processor.get_response_status_phrase()

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        """Status of request `idx`; a code >= 400 fails that request with `phrase`."""
        if self.request_processor:
            self.request_processor[idx].report_status(code, phrase)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for processor in self.request_processor:
            processor.report_status(code, phrase)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self.request_processor[idx].get_response_headers()

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.request_processor[idx].add_response_property(key, value)

    def get_sequence_id(self, idx: int) -> str | None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Context) and self.__dict__ == other.__dict__

    __hash__ = object.__hash__
