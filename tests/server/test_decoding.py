"""What the data plane does to a request around its run, in-process: its inputs checked against
the model's signature, its answer's outputs selected as the request asked."""

from __future__ import annotations

import numpy as np
import pytest

from scriptserve.handlers.runtime.signature import Signature, TensorSpec
from scriptserve.server.errors import InvalidInput
from scriptserve.server.inference.decoding import check_signature, select_outputs


def test_outputs_are_selected_in_the_order_asked() -> None:
    outputs = {"a": np.zeros(1), "b": np.ones(1)}
    assert [n for n, _ in select_outputs("m", outputs, [])] == ["a", "b"]
    assert [n for n, _ in select_outputs("m", outputs, ["b", "a"])] == ["b", "a"]
    with pytest.raises(InvalidInput, match=r"unknown output\(s\) c; the model's are a, b"):
        select_outputs("m", outputs, ["c"])


def test_a_model_that_answers_with_a_body_has_no_tensors() -> None:
    with pytest.raises(InvalidInput, match="answers with a body, not tensors; call /predictions"):
        select_outputs("m", {}, [])


SIGNATURE = Signature((TensorSpec("x", "FP32", (-1, 8)), TensorSpec("m", "INT64", (-1, 1))))


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"z": np.zeros((1, 8), np.float32)}, "unknown input 'z'; the model's inputs are x, m"),
        (
            {"x": np.zeros((1, 8), np.float64)},
            "input 'x' has datatype FP64; the model expects FP32",
        ),
        ({"x": np.zeros((1, 7), np.float32)}, r"input 'x' has shape \[1, 7\]; the model expects"),
        ({"x": np.zeros(8, np.float32)}, r"input 'x' has shape \[8\]"),
        ({"x": np.zeros((2, 8), np.float32)}, r"model 'm': missing input\(s\): m"),
    ],
)
def test_tensor_requests_are_checked_against_the_signature(
    inputs: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        check_signature("m", SIGNATURE, inputs)
    check_signature(
        "m", SIGNATURE, {"x": np.zeros((3, 8), np.float32), "m": np.zeros((3, 1), np.int64)}
    )
