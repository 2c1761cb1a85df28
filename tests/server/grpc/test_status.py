"""The one table from the error hierarchy to gRPC codes covers every error class."""

from __future__ import annotations

import inspect

import grpc

from scriptserve.server import errors
from scriptserve.server.grpc.status import GRPC_CODES, status_code


def test_every_error_class_has_its_row() -> None:
    classes = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.ServingError)
    }
    assert classes == set(GRPC_CODES)


def test_codes_follow_the_http_status() -> None:
    assert status_code(errors.QueueFull("full")) is grpc.StatusCode.UNAVAILABLE
    assert status_code(errors.InvalidInput("bad", status=418)) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(errors.error_for_status(404, "gone")) is grpc.StatusCode.NOT_FOUND
    assert status_code(errors.error_for_status(503, "busy")) is grpc.StatusCode.UNAVAILABLE
    assert status_code(errors.error_for_status(500, "crash")) is grpc.StatusCode.INTERNAL


def test_a_subclass_takes_its_nearest_listed_base() -> None:
    class Gone(errors.ModelNotFound):
        pass

    assert status_code(Gone("x")) is grpc.StatusCode.NOT_FOUND
