"""A JSON infer request whose text differs from an earlier one only inside its numbers is read
as those numbers alone: the result must be the one the whole document decodes to, bit for bit,
and anything else must be decoded whole (its errors unchanged)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scriptserve.server.codec import oip_json
from scriptserve.server.codec.tensors import tensor_dtype
from scriptserve.server.errors import InvalidInput


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    oip_json._ENVELOPES.clear()
    yield
    oip_json._ENVELOPES.clear()


def _decoded(body: bytes, length: str | None = None) -> oip_json.OipRequest | InvalidInput:
    try:
        return oip_json.decode_request(body, length, {})
    except InvalidInput as exc:
        return exc


def _general(body: bytes, length: str | None = None) -> oip_json.OipRequest | InvalidInput:
    """The whole request decoded, nothing remembered (and what was, kept for after)."""
    memo = oip_json._ENVELOPES if length is None else oip_json._HEADERS
    kept = dict(memo)
    memo.clear()
    try:
        return _decoded(body, length)
    finally:
        memo.clear()
        memo.update(kept)


def _same(a: oip_json.OipRequest | InvalidInput, b: oip_json.OipRequest | InvalidInput) -> None:
    if isinstance(a, InvalidInput) or isinstance(b, InvalidInput):
        assert isinstance(a, InvalidInput) and isinstance(b, InvalidInput)
        assert a.message == b.message
        return
    assert a.inference.inputs.keys() == b.inference.inputs.keys()
    for name, array in a.inference.inputs.items():
        other = b.inference.inputs[name]
        assert array.dtype == other.dtype and array.shape == other.shape
        assert array.tobytes() == other.tobytes()
    assert a.inference.parameters == b.inference.parameters
    assert a.inference.outputs == b.inference.outputs
    assert (a.id, a.requested, a.binary_default) == (b.id, b.requested, b.binary_default)
    if a.id:  # the client's id names the request; otherwise each gets its own
        assert a.inference.request_id == b.inference.request_id == a.id


_numbers = st.one_of(st.integers(-300, 300), st.floats(-1e6, 1e6, allow_nan=False, width=32))
_rarely = st.integers(0, 5).map(lambda n: n == 5)  # hypothesis leans to small draws
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4))
_texts = st.sampled_from(["x", "in", "x", "a[0]", "data"])


@st.composite
def _envelopes(draw: st.DrawFn) -> tuple[dict[str, Any], list[int], str]:
    """A request with its input's `data` left to fill, the input's shape and datatype."""
    shape = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    datatype = draw(st.sampled_from(["FP32", "FP32", "FP64", "INT64", "INT8", "UINT8", "BYTES"]))
    spec: dict[str, Any] = {"name": draw(_texts), "shape": shape, "datatype": datatype}
    if draw(_rarely):
        spec["parameters"] = draw(st.dictionaries(_texts, _scalars, max_size=2))
    keys = [*spec, "data"]
    order = draw(st.permutations(keys)) if draw(_rarely) else keys  # clients write `data` last
    doc: dict[str, Any] = {}
    if draw(_rarely):
        doc["id"] = draw(st.text(max_size=5))
    doc["inputs"] = [{k: spec.get(k) for k in order}]
    if draw(_rarely):
        doc["inputs"].append({"name": "y", "shape": [1], "datatype": "FP32", "data": [1.0]})
    if draw(_rarely):
        doc["parameters"] = draw(
            st.dictionaries(_texts, st.one_of(_scalars, st.lists(_scalars, max_size=2)), max_size=2)
        )
    if draw(_rarely):
        doc["outputs"] = [{"name": draw(_texts)}]
    if draw(_rarely):
        doc = dict(zip(draw(st.permutations(list(doc))), [None] * len(doc), strict=True)) | doc
    return doc, shape, datatype


def _body(doc: dict[str, Any], data: Any, indent: int | None) -> bytes:
    filled = json.loads(json.dumps(doc))
    for spec in filled["inputs"]:
        if spec.get("data") is None:
            spec["data"] = data
    return json.dumps(filled, indent=indent).encode()


def _data(draw: st.DrawFn, shape: list[int]) -> Any:
    count = int(np.prod(shape))
    extra = 1 if draw(_rarely) else 0  # a value too many: the general path's error
    flat: list[Any] = draw(st.lists(_numbers, min_size=count, max_size=count + extra))
    if flat and draw(_rarely):
        flat[draw(st.integers(0, len(flat) - 1))] = "x"  # not a number
    if draw(st.booleans()) and len(shape) > 1 and len(flat) == count:
        return np.array(flat, dtype=object).reshape(shape).tolist()  # nested: read as flat
    return flat


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_an_envelope_read_again_decodes_as_the_whole_document(data: st.DataObject) -> None:
    doc, shape, _ = data.draw(_envelopes())
    indent = data.draw(st.sampled_from([None, 1]))
    first = _body(doc, _data(data.draw, shape), indent)
    second = _body(doc, _data(data.draw, shape), indent)
    _same(_decoded(first), _general(first))
    _same(_decoded(second), _general(second))  # read through the first's envelope, if kept


def _request(data: str, *, before: str = "", after: str = "", name: str = "x") -> bytes:
    return (
        f'{{{before}"inputs": [{{"name": "{name}", "shape": [1, 3], "datatype": "FP32", '
        f'"data": {data}}}]{after}}}'
    ).encode()


def test_an_envelope_with_arrays_after_the_numbers_is_kept() -> None:
    # What the Triton client sends: the outputs it asks for after the inputs.
    after = ', "outputs": [{"name": "y", "parameters": {"binary_data": false}}]'
    oip_json.decode_request(_request("[1, 2, 3]", after=after), None, {})
    assert len(oip_json._ENVELOPES) == 1
    fast = oip_json._from_envelope(_request("[7, 8, 9]", after=after), None)
    assert fast is not None
    assert fast.inference.inputs["x"].tolist() == [[7.0, 8.0, 9.0]]
    assert fast.requested == {"y": False} and fast.inference.outputs == ["y"]


def test_a_known_envelope_is_read_as_its_numbers_alone() -> None:
    first = oip_json.decode_request(_request("[1, 2, 3]"), None, {})
    assert len(oip_json._ENVELOPES) == 1
    body = _request("[4.5, 5, 6]")
    fast = oip_json._from_envelope(body, {"h": "v"})
    assert fast is not None
    assert fast.inference.inputs["x"].tolist() == [[4.5, 5.0, 6.0]]
    assert fast.inference.headers == {"h": "v"}
    assert fast.inference.request_id != first.inference.request_id
    # What it hands out is its own: a handler changing it changes nothing remembered.
    fast.inference.parameters["k"] = 1
    fast.requested["y"] = True
    again = oip_json._from_envelope(body, None)
    assert again is not None and again.inference.parameters == {} and again.requested == {}


@pytest.mark.parametrize(
    "body",
    [
        _request("[1, 2, 3]", before='"id": "r1", '),  # its id would name every request
        _request("[1, 2, 3]", after=', "parameters": {"data": [1]}'),  # two `data` keys
        _request("[1, 2, 3]", name="data"),  # a `"data"` that is not the key
        _request("[[1, 2, 3]]"),  # not flat
        _request("[1, 2, 3]", after=', "parameters": {"p": [1]}'),  # parameters not scalars
        _request("[1, 2, 3]", before='"parameters": {"x": "' + "a" * 1100 + '"}, '),  # long
    ],
)
def test_envelopes_that_could_read_wrong_are_not_kept(body: bytes) -> None:
    oip_json.decode_request(body, None, {})
    assert not oip_json._ENVELOPES


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("[1, 2]", r"shape \[1, 3\] needs 3 values, got 2"),
        ('[1, 2, "x"]', "data is not a valid FP32 array"),
        ("[1, 2, 3", "not valid JSON"),
        ("[1, 2, 3], [4]", "not valid JSON"),
    ],
)
def test_other_numbers_in_a_known_envelope_are_refused_as_before(data: str, message: str) -> None:
    oip_json.decode_request(_request("[1, 2, 3]"), None, {})
    assert oip_json._ENVELOPES
    with pytest.raises(InvalidInput, match=message):
        oip_json.decode_request(_request(data), None, {})


def test_envelopes_kept_are_bounded() -> None:
    for i in range(200):  # a client making a new envelope each time
        body = _request("[1, 2, 3]", before=f'"parameters": {{"n": {i}}}, ')
        oip_json.decode_request(body, None, {})
    assert 0 < len(oip_json._ENVELOPES) <= 64


# -- a batch's bodies read together -----------------------------------------------------------


def _decoded_alone(body: bytes) -> oip_json.OipRequest | InvalidInput:
    wire = oip_json.OipBody(body, None, {})
    try:
        wire.decode()
    except InvalidInput as exc:
        return exc
    assert wire._decoded is not None
    return wire._decoded


def _decoded_together(bodies: list[bytes]) -> list[oip_json.OipRequest | InvalidInput]:
    wires = [oip_json.OipBody(body, None, {}) for body in bodies]
    oip_json.OipBody.read_together(wires)
    out: list[oip_json.OipRequest | InvalidInput] = []
    for wire in wires:
        try:
            wire.decode()
        except InvalidInput as exc:
            out.append(exc)
            continue
        assert wire._decoded is not None
        out.append(wire._decoded)
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_batch_read_together_decodes_as_each_body_alone(data: st.DataObject) -> None:
    doc, shape, _ = data.draw(_envelopes())
    indent = data.draw(st.sampled_from([None, 1]))
    bodies = [
        _body(doc, _data(data.draw, shape), indent) for _ in range(data.draw(st.integers(1, 4)))
    ]
    alone = [_decoded_alone(body) for body in bodies]  # the first keeps the envelope, if any
    for each, together in zip(alone, _decoded_together(bodies), strict=True):
        _same(each, together)


def test_bodies_around_one_envelope_are_read_in_one_parse() -> None:
    oip_json.decode_request(_request("[1, 2, 3]"), None, {})
    wires = [oip_json.OipBody(_request(d), None, {}) for d in ("[4, 5, 6]", "[7, 8, 9.5]")]

    oip_json.OipBody.read_together(wires)
    first, second = (wire.decode() for wire in wires)

    assert first.inputs["x"].tolist() == [[4.0, 5.0, 6.0]]
    assert second.inputs["x"].tolist() == [[7.0, 8.0, 9.5]]
    assert np.shares_memory(first.inputs["x"].base, second.inputs["x"])  # one array, one parse


@pytest.mark.parametrize(
    "bodies",
    [
        [_request("[4, 5, 6]"), _request("[1, 2]")],  # a row that does not fit: 400 alone
        [_request("[4, 5, 6]"), _request("[1, 2, 3", after="]")],  # not JSON alone
        [_request("[4, 5, 6]"), _request("[1, 2, 3]", name="y")],  # another envelope
        [_request("[4, 5, 6]"), _request('[1, "2", 3]')],
    ],
)
def test_a_batch_that_cannot_be_read_together_is_decoded_body_by_body(bodies: list[bytes]) -> None:
    oip_json.decode_request(_request("[1, 2, 3]"), None, {})
    expected = [_general(body) for body in bodies]

    got = _decoded_together(bodies)

    for each, together in zip(expected, got, strict=True):
        _same(each, together)
    assert isinstance(got[0], oip_json.OipRequest)


# -- binary requests: the JSON header remembered ----------------------------------------------


def _binary(header: dict[str, Any], raw: bytes) -> tuple[bytes, str]:
    text = json.dumps(header).encode()
    return text + raw, str(len(text))


@pytest.fixture(autouse=True)
def _forget_headers() -> Iterator[None]:
    oip_json._HEADERS.clear()
    yield
    oip_json._HEADERS.clear()


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    datatype=st.sampled_from(["FP32", "FP64", "INT64", "INT8", "UINT8", "BOOL", "FP16"]),
    extras=st.lists(st.integers(-4, 4), min_size=2, max_size=2),
    data=st.data(),
)
def test_a_remembered_header_decodes_as_the_whole_request(
    shape: list[int], datatype: str, extras: list[int], data: st.DataObject
) -> None:
    itemsize = tensor_dtype("x", datatype).itemsize
    size = int(np.prod(shape)) * itemsize
    tensor: dict[str, Any] = {
        "name": "x",
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }
    header: dict[str, Any] = {"inputs": [tensor]}
    if data.draw(_rarely):
        header["parameters"] = data.draw(st.dictionaries(_texts, _scalars, max_size=2))
    if data.draw(_rarely):
        header["outputs"] = [{"name": "y", "parameters": {"binary_data": data.draw(st.booleans())}}]
    if data.draw(_rarely):
        header["id"] = "r1"
    for extra in extras:  # the same header with as many bytes as it says, or more, or fewer
        raw = data.draw(st.binary(min_size=max(0, size + extra), max_size=max(0, size + extra)))
        body, length = _binary(header, raw)
        _same(_decoded(body, length), _general(body, length))


def test_a_header_is_remembered_and_read_again_without_its_json() -> None:
    header = {
        "inputs": [
            {
                "name": "x",
                "shape": [1, 2],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 8},
            }
        ]
    }
    body, length = _binary(header, np.array([1, 2], "<f4").tobytes())
    oip_json.decode_request(body, length, {})
    assert len(oip_json._HEADERS) == 1
    again, _ = _binary(header, np.array([3, 4.5], "<f4").tobytes())
    known = oip_json._from_header(again, int(length), {"h": "v"})
    assert known is not None
    assert known.inference.inputs["x"].tolist() == [[3.0, 4.5]]
    assert known.inference.headers == {"h": "v"}
    assert oip_json._from_header(again + b"\0", int(length), None) is None  # a byte too many


@pytest.mark.parametrize(
    "header",
    [
        {"id": "r1", "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                                 "parameters": {"binary_data_size": 8}}]},  # its id names them
        {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                     "parameters": {"binary_data_size": 8}}],
         "parameters": {"p": [1]}},  # parameters not scalars
        {"inputs": [{"name": "x", "shape": [2], "datatype": "BYTES",
                     "parameters": {"binary_data_size": 8}}]},
        {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                     "parameters": {"binary_data_size": 8, "pad": "a" * 1100}}]},  # long
        {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32",
                     "parameters": {"binary_data_size": 8}},
                    {"name": "y", "shape": [1], "datatype": "FP32", "data": [1]}]},
    ],
)  # fmt: skip
def test_headers_that_could_read_wrong_are_not_kept(header: dict[str, Any]) -> None:
    raw = (
        np.array([1, 2], "<f4").tobytes()
        if header["inputs"][0]["datatype"] == "FP32"
        else (b"\x00\x00\x00\x00" * 2)
    )
    body, length = _binary(header, raw)
    oip_json.decode_request(body, length, {})
    assert not oip_json._HEADERS
