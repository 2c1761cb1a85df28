"""JSON arrays of numbers read through simdjson's buffers: the same arrays as orjson + numpy give,
or None (the general path), never a different answer."""

from __future__ import annotations

import itertools
import json
import warnings
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scriptserve.handlers.runtime.json_numbers import (
    JsonArray,
    array_from_text,
    loads,
    rows_from_texts,
)
from scriptserve.handlers.runtime.signature import (
    Signature,
    SignatureError,
    TensorSpec,
    arrays_from_json,
    arrays_from_text,
    instances_from_texts,
)

DTYPES = [np.dtype(t) for t in ("float32", "float64", "float16", "int64", "int8", "uint8")]


def _general(text: bytes, dtype: np.dtype[Any]) -> np.ndarray | None:
    """What the general path makes of the text: orjson, then numpy; None when it refuses."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # float16 overflow to inf, on both paths
            return np.asarray(orjson.loads(text), dtype=dtype)
    except (orjson.JSONDecodeError, ValueError, TypeError, OverflowError):
        return None


def _same(fast: np.ndarray, general: np.ndarray | None) -> None:
    assert general is not None, "the fast path read what the general path refuses"
    assert fast.dtype == general.dtype
    assert fast.shape == general.shape
    assert fast.tobytes() == general.tobytes()  # bit for bit: same rounding, same -0.0


@pytest.mark.parametrize(
    ("text", "dtype", "shape"),
    [
        (b"[0.1234, -5e-3, 7, 1e30]", "float32", (4,)),
        (b" [ [1, 2.5] , [3, 4] ] ", "float64", (2, 2)),
        (b"[[[1], [2]], [[3], [4]], [[5], [6]]]", "float16", (3, 2, 1)),
        (b"[-128, 127, 0]", "int8", (3,)),
        (b"[9223372036854775807, -9223372036854775808]", "int64", (2,)),
        (b"[255, 0]", "uint8", (2,)),
        (b"[]", "float32", (0,)),
        (b"[[], []]", "float32", (2, 0)),
    ],
)
def test_arrays_of_numbers_are_read_from_the_buffer(text: bytes, dtype: str, shape: tuple) -> None:
    fast = array_from_text(text, np.dtype(dtype))
    assert fast is not None
    assert fast.shape == shape
    _same(fast, _general(text, np.dtype(dtype)))


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        (b"[[1, 2], [3]]", "float32"),  # ragged
        (b"[1, [2, 3], []]", "float32"),  # as many leaves as elements, nested all the same
        (b"[[1, [2, 3]], [[], 4]]", "float32"),  # right lengths, wrong nesting
        (b"[[1, 2, [3, 4, 5]], 6]", "float32"),  # as many leaves and arrays as a 2x3
        (b"[true, 1]", "float32"),  # numpy takes booleans: the general path answers
        (b'["1"]', "float32"),
        (b"[1.5]", "int64"),
        (b"[300]", "int8"),
        (b"[-1]", "uint8"),
        (b"[1e400]", "float64"),
        (b'{"x": [1]}', "float32"),
        (b"[1, 2", "float32"),
        (b"[1, 2]", "bool"),
    ],
)
def test_anything_else_is_left_to_the_general_path(text: bytes, dtype: str) -> None:
    assert array_from_text(text, np.dtype(dtype)) is None


_numbers = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)
_leaves = st.one_of(_numbers, st.booleans(), st.none(), st.text(max_size=3))
_nested = st.recursive(st.lists(_leaves, max_size=4), lambda inner: st.lists(inner, max_size=4))
_shapes = st.integers(1, 3).flatmap(
    lambda rank: st.lists(st.integers(0, 3), min_size=rank, max_size=rank)
)


def _filled(shape: list[int]) -> st.SearchStrategy[Any]:
    size = int(np.prod(shape))
    values = st.lists(_numbers, min_size=size, max_size=size)
    return values.map(lambda flat: np.array(flat, dtype=object).reshape(shape).tolist())


_rectangular = _shapes.flatmap(_filled)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(value=st.one_of(_nested, _rectangular), dtype=st.sampled_from(DTYPES))
def test_the_fast_path_never_answers_differently(value: Any, dtype: np.dtype[Any]) -> None:
    text = json.dumps(value).encode()
    fast = array_from_text(text, dtype)
    if fast is not None:
        _same(fast, _general(text, dtype))


@settings(max_examples=100, deadline=None)
@given(value=_rectangular, dtype=st.sampled_from(DTYPES[:3]))
def test_rectangular_numbers_take_the_fast_path(value: Any, dtype: np.dtype[Any]) -> None:
    text = json.dumps(value).encode()
    fast = array_from_text(text, dtype)
    general = _general(text, dtype)
    if general is not None and general.ndim == len(np.shape(value)):
        assert fast is not None
        _same(fast, general)


def _unlazy(value: Any) -> Any:
    if isinstance(value, JsonArray):
        return value.to_list()
    if isinstance(value, dict):
        return {k: _unlazy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unlazy(v) for v in value]
    return value


def _lazy_arrays(value: Any) -> list[JsonArray]:
    if isinstance(value, JsonArray):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _lazy_arrays(v)]
    if isinstance(value, list):
        return [a for v in value for a in _lazy_arrays(v)]
    return []


_documents = st.recursive(
    st.one_of(_leaves, _rectangular),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["data", "name", "shape", "[x"]), inner, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(document=_documents, dtype=st.sampled_from(DTYPES))
def test_loads_is_orjson_with_arrays_left_lazy(document: Any, dtype: np.dtype[Any]) -> None:
    text = json.dumps(document).encode()
    value = loads(text, lazy_key="data")
    assert _unlazy(value) == orjson.loads(text)
    for lazy in _lazy_arrays(value):
        fast = lazy.to_numpy(dtype)
        if fast is not None:
            _same(fast, _general(orjson.dumps(lazy.to_list()), dtype))


def test_loads_reads_an_oip_envelope() -> None:
    text = (
        b'{"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", '
        b'"data": [[1, 2], [3, 4]]}]}'
    )
    spec = loads(text, lazy_key="data")["inputs"][0]
    assert spec["shape"] == [2, 2]
    data = spec["data"]
    assert isinstance(data, JsonArray)
    array = data.to_numpy(np.dtype("float32"))
    assert array is not None
    assert array.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_loads_reads_a_text_without_the_key_as_orjson_does() -> None:
    # An OIP binary request's JSON header: nothing to leave lazy, so no walk of simdjson's values.
    header = b'{"inputs":[{"name":"x","shape":[1,2],"parameters":{"binary_data_size":8}}]}'
    assert loads(header, lazy_key="data") == orjson.loads(header)
    # The key written with an escape is the same key, read as a list for the general path.
    escaped = loads(b'{"\\u0064ata": [1, 2]}', lazy_key="data")
    assert escaped == {"data": [1, 2]}
    with pytest.raises(orjson.JSONDecodeError):
        loads(b'{"inputs": [', lazy_key="data")


def test_loads_leaves_arrays_with_a_bracket_in_a_string_to_the_general_path() -> None:
    # The count of "[" that proves no array hides among the numbers cannot tell a string's.
    value = loads(b'{"name": "x[0]", "data": [1, 2]}', lazy_key="data")
    assert value["data"].to_numpy(np.dtype("float32")) is None
    assert value["data"].to_list() == [1, 2]


def test_loads_keeps_the_last_of_a_repeated_key_and_orjsons_errors() -> None:
    assert loads(b'{"data": [1], "data": [2, 3]}', lazy_key="data") == {"data": [2, 3]}
    with pytest.raises(orjson.JSONDecodeError, match="unexpected end of data"):
        loads(b'{"data": [1', lazy_key="data")


def test_arrays_from_text_is_arrays_from_json_for_one_input() -> None:
    signature = Signature((TensorSpec("x", "FP32", (-1, 2, 2)),))
    text = b"[[1, 2], [3, 4]]"
    fast = arrays_from_text(text, signature)
    assert fast is not None
    general = arrays_from_json(orjson.loads(text), signature)
    assert fast.keys() == general.keys()
    _same(fast["x"], general["x"])
    with pytest.raises(SignatureError, match=r"has shape \[2\] per instance; the model expects"):
        arrays_from_text(b"[1, 2]", signature)
    two = Signature((TensorSpec("a", "FP32", (-1, 2)), TensorSpec("b", "FP32", (-1, 2))))
    assert arrays_from_text(text, two) is None  # the general path names the inputs


def test_deep_nesting_is_left_to_the_general_path() -> None:
    deep = b"[" * 900 + b"1" + b"]" * 900  # within simdjson's depth, beyond any tensor's rank
    assert array_from_text(deep, np.dtype("float32")) is None
    lazy = loads(b'{"data": ' + deep + b"}", lazy_key="data")["data"]
    assert lazy.to_numpy(np.dtype("float32")) is None
    nested = b'{"p": ' + b'{"p": ' * 900 + b"1" + b"}" * 901
    assert loads(nested, lazy_key="data") == orjson.loads(nested)


# -- a batch of rows read in one parse --------------------------------------------------------

_spaces = st.sampled_from([b"", b" ", b"\n", b"\t", b"\r\n  "])
_flat = st.integers(0, 4).flatmap(lambda n: st.lists(_numbers, min_size=n, max_size=n))


def _each_alone(texts: list[bytes], rows: np.ndarray, dtype: np.dtype[Any]) -> None:
    """Every row of the batch is what its own text reads as, alone, bit for bit."""
    assert rows.shape[0] == len(texts)
    for text, row in zip(texts, rows, strict=True):
        alone = array_from_text(text, dtype)
        assert alone is not None, f"{text!r} is read in a batch but not alone"
        _same(row, alone)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@settings(max_examples=70, deadline=None)
@given(
    width=st.integers(0, 4),
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
)
def test_rows_of_one_width_are_read_in_one_parse_as_each_alone(
    width: int, data: st.DataObject, dtype: np.dtype[Any]
) -> None:
    values = data.draw(st.lists(st.lists(_numbers, min_size=width, max_size=width), min_size=1))
    texts = [data.draw(_spaces) + json.dumps(v).encode() + data.draw(_spaces) for v in values]
    rows = rows_from_texts(texts, dtype)
    if all(array_from_text(text, dtype) is not None for text in texts):
        assert rows is not None, "rows that each read alone are read together"
    if rows is not None:
        _each_alone(texts, rows, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.one_of(_flat, _nested), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    dtype=st.sampled_from(DTYPES[:3]),
)
def test_texts_cut_anywhere_never_lend_numbers_to_another_row(
    values: list[Any], cuts: list[int], dtype: np.dtype[Any]
) -> None:
    # The texts of several clients, cut at any points and handed over as other texts: whatever
    # is read in one parse is what each text is alone.
    whole = b",".join(json.dumps(v).encode() for v in values)
    points = sorted({min(c, len(whole)) for c in cuts} | {0, len(whole)})
    texts = [whole[a:b] for a, b in itertools.pairwise(points)] or [whole]
    rows = rows_from_texts(texts, dtype)
    if rows is not None:
        _each_alone(texts, rows, dtype)


@pytest.mark.parametrize(
    "texts",
    [
        [b"[1, 2", b"3], [4, 5, 6]"],  # valid once joined, neither alone
        [b"[1, 2, 3", b"], [4, 5, 6]"],
        [b"[1, 2], [3, 4]", b"[5, 6]"],  # two rows in one text
        [b"[1], [2", b"3]"],
        [b"[1, 2]", b"[3]"],  # ragged
        [b"[[1, 2]]", b"[[3, 4]]"],  # an instance with rows of its own
        [b"\x0c[1, 2]", b"[3, 4]"],  # a form feed is not JSON whitespace
        [b'[1, "2"]', b"[3, 4]"],
        [b"[1, 2]", b"{}"],
        [],
    ],
)
def test_anything_but_flat_rows_of_one_width_is_read_text_by_text(texts: list[bytes]) -> None:
    assert rows_from_texts(texts, np.dtype("float32")) is None


def test_instances_are_what_arrays_from_text_makes_of_each_text() -> None:
    signature = Signature((TensorSpec("x", "FP32", (-1, 3)),))
    texts = [b"[1, 2, 3]", b" [4, 5, 6.5] "]
    instances = instances_from_texts(texts, signature)
    assert instances is not None
    for text, instance in zip(texts, instances, strict=True):
        alone = arrays_from_text(text, signature)
        assert alone is not None
        assert instance.keys() == alone.keys() == {"x"}
        _same(instance["x"], alone["x"])
    # A width the model does not take is left to the text-by-text path, which says so.
    assert instances_from_texts([b"[1, 2]", b"[3, 4]"], signature) is None
    two = Signature((TensorSpec("a", "FP32", (-1, 3)), TensorSpec("b", "FP32", (-1, 3))))
    assert instances_from_texts(texts, two) is None
    unsigned = instances_from_texts(texts, Signature())
    assert unsigned is not None
    assert [set(i) for i in unsigned] == [{"input0"}, {"input0"}]
