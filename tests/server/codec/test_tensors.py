"""The tensor codec in-process: every check on a client's tensor, REST and gRPC alike."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from scriptserve.handlers.runtime.signature import Signature, SignatureError, TensorSpec
from scriptserve.server.codec.tensors import (
    add_input,
    check_shape,
    decode_raw,
    encode_raw,
    from_values,
    raw_output,
)
from scriptserve.server.errors import InvalidInput


def test_values_take_the_shape_in_row_major_order() -> None:
    array = from_values("x", "INT32", [2, 3], [[1, 2, 3], [4, 5, 6]])
    assert array.dtype == np.int32
    assert array.tolist() == [[1, 2, 3], [4, 5, 6]]
    flat = from_values("x", "FP32", [2, 2], [1.0, 2.0, 3.0, 4.0])  # gRPC typed contents
    assert flat.shape == (2, 2)


@pytest.mark.parametrize(
    ("shape", "values", "message"),
    [
        ([2, 2], [1.0, 2.0, 3.0], "shape [2, 2] needs 4 values, got 3"),
        ([0, 4], [1.0], "shape [0, 4] needs 0 values, got 1"),
        ([1], ["a"], "data is not a valid FP32 array"),
    ],
)
def test_values_that_do_not_fit_are_named(
    shape: list[int], values: list[object], message: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        from_values("x", "FP32", shape, values)


def test_an_integer_out_of_its_datatype_range_is_refused() -> None:
    with pytest.raises(InvalidInput, match="not a valid INT8 array"):
        from_values("x", "INT8", [1], [300])


def test_bytes_elements_are_strings_never_numbers() -> None:
    array = from_values("t", "BYTES", [2], ["ab", "c\x00"])
    assert array.tolist() == [b"ab", b"c\x00"]  # no numpy bytes dtype: trailing NULs kept
    # bytes(N) of a JSON integer would allocate N bytes the client never sent.
    with pytest.raises(InvalidInput, match="a BYTES element must be a string"):
        from_values("t", "BYTES", [1], [1099511627776])


@pytest.mark.parametrize("shape", [[True, 4], [-1, 4], [1.5], "12", None, [[1]]])
def test_a_shape_is_a_list_of_non_negative_integers(shape: object) -> None:
    with pytest.raises(InvalidInput, match="'shape' must be a list of non-negative integers"):
        check_shape("x", shape)


def test_raw_bytes_round_trip_every_numeric_datatype() -> None:
    for dtype in (np.bool_, np.uint8, np.int16, np.int64, np.float16, np.float32, np.float64):
        array = (
            (np.arange(6) % 2 if dtype is np.bool_ else np.arange(6)).astype(dtype).reshape(2, 3)
        )
        datatype = {
            np.bool_: "BOOL",
            np.uint8: "UINT8",
            np.int16: "INT16",
            np.int64: "INT64",
            np.float16: "FP16",
            np.float32: "FP32",
            np.float64: "FP64",
        }[dtype]
        back = decode_raw("x", datatype, [2, 3], encode_raw(array))
        assert back.dtype == array.dtype and np.array_equal(back, array)


def test_raw_bytes_must_match_the_shape_exactly() -> None:
    with pytest.raises(InvalidInput, match="needs 16 bytes, got 12"):
        decode_raw("x", "FP32", [2, 2], b"\0" * 12)


def test_raw_bytes_elements_are_length_prefixed() -> None:
    raw = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 0)
    assert decode_raw("t", "BYTES", [2], raw).tolist() == [b"hi", b""]
    assert raw_output(np.array([b"hi", b""], dtype=np.object_)) == ("BYTES", raw)
    with pytest.raises(InvalidInput, match="truncated BYTES element length"):
        decode_raw("t", "BYTES", [2], raw + b"\x01")
    with pytest.raises(InvalidInput, match="needs 3 BYTES elements"):
        decode_raw("t", "BYTES", [3], raw)


def test_unknown_and_unsupported_datatypes_are_named() -> None:
    with pytest.raises(InvalidInput, match="input 'x': BF16 is not supported"):
        from_values("x", "BF16", [1], [1.0])
    with pytest.raises(InvalidInput, match="input 'x'"):
        decode_raw("x", "FP128", [1], b"")


def test_an_input_sent_twice_is_refused() -> None:
    inputs: dict[str, np.ndarray] = {}
    add_input(inputs, "x", np.zeros(1))
    with pytest.raises(InvalidInput, match="input 'x' appears twice"):
        add_input(inputs, "x", np.zeros(1))


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([0, 2**63 - 1], "a dimension is larger than 2147483647"),
        ([0, 2**31], "a dimension is larger than"),
        ([1] * 33, "33 dimensions; at most 32"),
    ],
)
def test_shapes_are_bounded_before_anything_is_allocated(shape: list[int], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        check_shape("x", shape)
    assert check_shape("x", [0, 2**31 - 1]) == [0, 2**31 - 1]


def test_bytes_elements_need_their_length_prefixes() -> None:
    with pytest.raises(InvalidInput, match="8 bytes cannot hold them"):
        decode_raw("t", "BYTES", [1000000], b"\0" * 8)


def test_a_signature_remembers_what_it_accepted_and_still_refuses_the_rest() -> None:
    signature = Signature((TensorSpec("x", "FP32", (-1, 8)), TensorSpec("m", "INT64", (-1, 1))))
    good = {"x": np.zeros((2, 8), np.float32), "m": np.zeros((2, 1), np.int64)}
    signature.check_inputs(good)
    signature.check_inputs(good)  # remembered: the same (name, dtype, shape) twice
    # Each input was accepted before, but one is missing, or one differs in a way not seen.
    with pytest.raises(SignatureError, match=r"missing input\(s\): m"):
        signature.check_inputs({"x": good["x"]})
    with pytest.raises(SignatureError, match="has datatype FP64"):
        signature.check_inputs({"x": np.zeros((2, 8), np.float64), "m": good["m"]})
    with pytest.raises(SignatureError, match=r"has shape \[2, 7\]"):
        signature.check_inputs({"x": np.zeros((2, 7), np.float32), "m": good["m"]})
    # A client sending a new batch size each time cannot grow what is remembered without end.
    for rows in range(1, 400):
        signature.check_inputs(
            {"x": np.zeros((rows, 8), np.float32), "m": np.zeros((rows, 1), np.int64)}
        )
    assert len(signature._accepted) <= 256
    with pytest.raises(SignatureError, match=r"has shape \[399, 9\]"):
        signature.check_inputs({"x": np.zeros((399, 9), np.float32), "m": np.zeros((399, 1))})
