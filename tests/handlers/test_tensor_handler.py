"""The built-in `tensor` handler on real archives: batching, JSON bodies, per-request failures."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ArchiveFactory, reference_output, save_torchscript
from torch import nn

from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.manifest import Manifest
from scriptserve.handlers.base import Context, InferenceRequest, InferenceResponse
from scriptserve.handlers.loader import load_handler, read_model_config
from scriptserve.handlers.runtime.signature import Signature, TensorSpec
from scriptserve.handlers.tensor import TensorBatch, TensorHandler

OUTPUT_NAME = {"torchscript": "output0", "onnx": "y"}

Served = tuple[TensorHandler, Context]


class RowSum(nn.Module):
    """Sums each row: (batch, n) -> (batch, 1) for any n, so dim 1 is dynamic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1, keepdim=True)


@contextmanager
def served(archive: Path, manifest: Manifest | None = None) -> Iterator[Served]:
    """Open `archive` and load its handler the way a worker does; `manifest` overrides its own."""
    with open_archive(archive) as reader:
        manifest = manifest or reader.manifest
        context = Context(
            model_name=manifest.model.model_name,
            model_version=manifest.model.model_version,
            model_dir=reader.root,
            manifest=manifest,
            model_config=read_model_config(reader.root, manifest),
        )
        handler = load_handler(context)
        assert isinstance(handler, TensorHandler)
        yield handler, context


def rows(n: int, seed: int, width: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def json_request(value: object) -> InferenceRequest:
    return InferenceRequest(body=json.dumps(value).encode(), content_type="application/json")


def output(response: InferenceResponse) -> np.ndarray:
    assert response.error is None, response.error
    assert response.status == 200
    (tensor,) = response.outputs.values()
    return tensor


@pytest.fixture(params=["torchscript", "onnx"])
def tiny(
    request: pytest.FixtureRequest,
    torchscript_file: Path,
    onnx_file: Path,
    make_archive: ArchiveFactory,
) -> Iterator[Served]:
    model = torchscript_file if request.param == "torchscript" else onnx_file
    with served(make_archive(model)) as pair:
        yield pair


def test_batch_of_tensor_requests_each_get_their_own_rows(tiny: Served) -> None:
    handler, context = tiny
    xs = [rows(1, seed=1), rows(3, seed=2), rows(1, seed=3), rows(3, seed=4)]

    responses = handler.handle([InferenceRequest(inputs={"x": x}) for x in xs], context)

    assert len(responses) == 4
    for x, response in zip(xs, responses, strict=True):
        got = output(response)
        assert got.shape == (len(x), 3)
        np.testing.assert_allclose(got, reference_output(x), rtol=1e-5, atol=1e-6)
        assert response.body is None


def test_batch_of_json_requests_answer_with_their_row_as_a_list(tiny: Served) -> None:
    handler, context = tiny
    xs = [rows(1, seed=s) for s in range(5)]

    responses = handler.handle([json_request(x[0].tolist()) for x in xs], context)

    for x, response in zip(xs, responses, strict=True):
        np.testing.assert_allclose(output(response), reference_output(x), rtol=1e-5, atol=1e-6)
        assert isinstance(response.body, list)
        assert len(response.body) == 3
        np.testing.assert_allclose(response.body, reference_output(x)[0], rtol=1e-5, atol=1e-6)


def test_json_object_body_names_the_input(tiny: Served) -> None:
    handler, context = tiny
    x = rows(1, seed=9)

    (response,) = handler.handle([json_request({"x": x[0].tolist()})], context)

    np.testing.assert_allclose(response.body, reference_output(x)[0], rtol=1e-5, atol=1e-6)


def test_json_and_tensor_requests_share_a_batch(tiny: Served) -> None:
    handler, context = tiny
    a, b = rows(2, seed=5), rows(1, seed=6)

    tensor_response, json_response = handler.handle(
        [InferenceRequest(inputs={"x": a}), json_request(b[0].tolist())], context
    )

    np.testing.assert_allclose(output(tensor_response), reference_output(a), rtol=1e-5, atol=1e-6)
    assert tensor_response.body is None
    np.testing.assert_allclose(json_response.body, reference_output(b)[0], rtol=1e-5, atol=1e-6)


BAD_REQUESTS: dict[str, tuple[InferenceRequest, list[str]]] = {
    "wrong shape": (
        InferenceRequest(inputs={"x": np.ones((2, 5), np.float32)}),
        ["input 'x' has shape [2, 5]", "the model expects [-1, 8]"],
    ),
    "wrong dtype": (
        InferenceRequest(inputs={"x": np.ones((2, 8), np.float64)}),
        ["input 'x' has datatype FP64", "the model expects FP32"],
    ),
    "unknown input": (
        InferenceRequest(inputs={"z": np.ones((1, 8), np.float32)}),
        ["unknown input 'z'", "the model's inputs are x"],
    ),
    "bad json": (
        InferenceRequest(body=b"[0.5, 0.5,", content_type="application/json"),
        ["the body is not valid JSON"],
    ),
    "json of wrong length": (
        json_request([0.5] * 5),
        ["input 'x' has shape [5] per instance", "the model expects [8]"],
    ),
    "json object without the input": (json_request({}), ["missing input(s): x"]),
    "no inputs at all": (InferenceRequest(), ["no input tensors and no body"]),
    "ragged json": (
        json_request([[0.5] * 8, [0.5]]),
        ["input 'x' is not a rectangular FP32 array"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_fails_alone_with_a_clear_message(tiny: Served, case: str) -> None:
    handler, context = tiny
    bad, expected_phrases = BAD_REQUESTS[case]
    good_before, good_after = rows(1, seed=10), rows(3, seed=11)

    before, failed, after = handler.handle(
        [
            InferenceRequest(inputs={"x": good_before}),
            bad,
            InferenceRequest(inputs={"x": good_after}),
        ],
        context,
    )

    assert failed.status == 400
    assert failed.error is not None
    for phrase in expected_phrases:
        assert phrase in failed.error
    assert failed.outputs == {}
    np.testing.assert_allclose(output(before), reference_output(good_before), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output(after), reference_output(good_after), rtol=1e-5, atol=1e-6)


def test_a_batch_of_only_bad_requests_answers_each(tiny: Served) -> None:
    handler, context = tiny
    bad = [BAD_REQUESTS["wrong dtype"][0], BAD_REQUESTS["bad json"][0]]

    responses = handler.handle(bad, context)

    assert [r.status for r in responses] == [400, 400]
    assert all(r.error for r in responses)


def test_a_batch_of_json_rows_is_read_in_one_parse(tiny: Served) -> None:
    handler, _ = tiny
    xs = [rows(1, seed=s) for s in range(4)]
    requests = [json_request(x[0].tolist()) for x in xs]

    batch = handler.preprocess(requests)

    assert batch.errors == {}
    (group,) = batch.groups
    assert [item.index for item in group] == [0, 1, 2, 3]
    for x, item in zip(xs, group, strict=True):
        np.testing.assert_array_equal(item.arrays["x"], x)
    # One parse: the rows are views of one array.
    assert all(np.shares_memory(group[0].arrays["x"].base, i.arrays["x"]) for i in group)


def test_alike_tensor_requests_make_one_group_checked_once(tiny: Served) -> None:
    handler, context = tiny
    xs = [rows(2, seed=s) for s in (41, 42, 43)]
    requests = [InferenceRequest(inputs={"x": x}) for x in xs]

    batch = handler.preprocess(requests)
    responses = handler.handle(requests, context)

    assert batch.errors == {}
    assert [[(item.index, item.rows) for item in group] for group in batch.groups] == [
        [(0, 2), (1, 2), (2, 2)]
    ]
    for x, response in zip(xs, responses, strict=True):
        np.testing.assert_allclose(output(response), reference_output(x), rtol=1e-5, atol=1e-6)


def test_alike_tensor_requests_the_model_refuses_each_fail_with_the_reason(tiny: Served) -> None:
    handler, context = tiny
    requests = [InferenceRequest(inputs={"x": np.ones((1, 5), np.float32)}) for _ in range(3)]

    responses = handler.handle(requests, context)

    assert [r.status for r in responses] == [400, 400, 400]
    assert all("input 'x' has shape [1, 5]" in (r.error or "") for r in responses)


@pytest.mark.parametrize(
    ("bodies", "bad", "phrase"),
    [
        ([b"[0.5, 0.5, 0.5, 0.5", b"0.5, 0.5, 0.5, 0.5]"], [0, 1], "the body is not valid JSON"),
        (
            [b"[0.5, 0.5, 0.5, 0.5", b"0.5, 0.5, 0.5, 0.5], [" + b"0.5, " * 7 + b"0.5]"],
            [0, 1],
            "the body is not valid JSON",
        ),
        ([b"[0.5, 0.5, 0.5, 0.5, 0.5]"], [0], "input 'x' has shape [5] per instance"),
        ([b"[0.5, 0.5,"], [0], "the body is not valid JSON"),
    ],
)
def test_a_bad_json_row_among_good_ones_fails_alone(
    tiny: Served, bodies: list[bytes], bad: list[int], phrase: str
) -> None:
    # Two halves of one row, sent as two requests, are each invalid: neither borrows the
    # other's numbers, and the well-formed rows around them are answered.
    handler, context = tiny
    good = [rows(1, seed=s) for s in (31, 32)]
    requests = [json_request(good[0][0].tolist())]
    requests += [InferenceRequest(body=b, content_type="application/json") for b in bodies]
    requests.append(json_request(good[1][0].tolist()))

    responses = handler.handle(requests, context)

    for index in bad:
        failed = responses[1 + index]
        assert failed.status == 400
        assert failed.error is not None
        assert phrase in failed.error
    for x, response in zip(good, (responses[0], responses[-1]), strict=True):
        np.testing.assert_allclose(response.body, reference_output(x)[0], rtol=1e-5, atol=1e-6)


# -- a model with a dynamic non-batch dimension ------------------------------------------------


def rowsum_onnx(path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            RowSum().eval(),
            (torch.zeros(1, 4),),
            str(path),
            input_names=["x"],
            output_names=["total"],
            dynamic_axes={"x": {0: "batch", 1: "width"}, "total": {0: "batch"}},
            dynamo=False,
        )
    return path


def with_dynamic_width(manifest: Manifest) -> Manifest:
    """The TorchScript archive records the sample's width (8); declare dim 1 dynamic instead."""
    assert manifest.scriptserve is not None
    assert manifest.signature.inputs == (TensorSpec("x", "FP32", (-1, 8)),)
    signature = Signature((TensorSpec("x", "FP32", (-1, -1)),), manifest.signature.outputs)
    return manifest.with_scriptserve(replace(manifest.scriptserve, signature=signature))


@pytest.fixture(params=["torchscript", "onnx"])
def rowsum(
    request: pytest.FixtureRequest, tmp_path: Path, make_archive: ArchiveFactory
) -> Iterator[Served]:
    if request.param == "onnx":
        archive = make_archive(rowsum_onnx(tmp_path / "rowsum.onnx"), name="rowsum")
        with served(archive) as pair:
            assert pair[1].signature.inputs == (TensorSpec("x", "FP32", (-1, -1)),)
            yield pair
        return
    archive = make_archive(save_torchscript(tmp_path / "rowsum.pt", RowSum()), name="rowsum")
    with open_archive(archive) as reader:
        manifest = with_dynamic_width(reader.manifest)
    with served(archive, manifest) as pair:
        yield pair


def test_requests_with_different_widths_run_in_separate_groups(rowsum: Served) -> None:
    handler, context = rowsum
    xs = [rows(1, seed=1, width=4), rows(2, seed=2, width=6), rows(3, seed=3, width=4)]
    requests = [InferenceRequest(inputs={"x": x}) for x in xs]
    requests.append(json_request([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))

    batch = handler.preprocess(requests)
    responses = handler.handle(requests, context)

    assert isinstance(batch, TensorBatch)
    assert batch.errors == {}
    assert sorted(sorted(item.index for item in group) for group in batch.groups) == [
        [0, 2],
        [1, 3],
    ]
    for x, response in zip(xs, responses[:3], strict=True):
        np.testing.assert_allclose(output(response), x.sum(axis=1, keepdims=True), rtol=1e-5)
    assert responses[3].body == [21.0]


# -- a model archived without a signature ------------------------------------------------------


@pytest.fixture
def unsigned(torchscript_file: Path, tmp_path: Path) -> Iterator[Served]:
    # make_archive always passes a sample; without one the archiver records no signature.
    export = tmp_path / "unsigned-store"
    argv = [
        "--model-name", "unsigned", "--version", "1.0",
        "--serialized-file", str(torchscript_file), "--export-path", str(export),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    with served(export / "unsigned.mar") as pair:
        assert pair[1].signature == Signature()
        yield pair


def test_model_without_signature_takes_a_json_body(unsigned: Served) -> None:
    handler, context = unsigned
    x = rows(1, seed=21)

    (response,) = handler.handle([json_request(x[0].tolist())], context)

    np.testing.assert_allclose(response.body, reference_output(x)[0], rtol=1e-5, atol=1e-6)


def test_model_without_signature_takes_a_batch_of_json_rows(unsigned: Served) -> None:
    handler, context = unsigned
    xs = [rows(1, seed=s) for s in (25, 26, 27)]

    responses = handler.handle([json_request(x[0].tolist()) for x in xs], context)

    for x, response in zip(xs, responses, strict=True):
        np.testing.assert_allclose(response.body, reference_output(x)[0], rtol=1e-5, atol=1e-6)


def test_model_without_signature_maps_a_generic_tensor_name(unsigned: Served) -> None:
    handler, context = unsigned
    x = rows(3, seed=22)

    (response,) = handler.handle([InferenceRequest(inputs={"input0": x})], context)

    np.testing.assert_allclose(output(response), reference_output(x), rtol=1e-5, atol=1e-6)


def test_model_without_signature_maps_the_name_of_alike_tensor_requests(unsigned: Served) -> None:
    handler, context = unsigned
    xs = [rows(1, seed=s) for s in (28, 29)]

    responses = handler.handle([InferenceRequest(inputs={"input0": x}) for x in xs], context)

    for x, response in zip(xs, responses, strict=True):
        np.testing.assert_allclose(output(response), reference_output(x), rtol=1e-5, atol=1e-6)


def test_model_without_signature_fails_only_the_group_it_rejects(unsigned: Served) -> None:
    # Without a signature nothing checks shapes before the model runs: the model itself rejects
    # the 5-wide request, which must not take the well-formed requests down with it.
    handler, context = unsigned
    good_a, good_b = rows(1, seed=23), rows(2, seed=24)

    first, rejected, second = handler.handle(
        [
            InferenceRequest(inputs={"input0": good_a}),
            InferenceRequest(inputs={"input0": rows(1, seed=25, width=5)}),
            InferenceRequest(inputs={"input0": good_b}),
        ],
        context,
    )

    assert rejected.status == 500
    assert rejected.error == (
        "the model failed: mat1 and mat2 shapes cannot be multiplied (1x5 and 8x16)"
    )
    np.testing.assert_allclose(output(first), reference_output(good_a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output(second), reference_output(good_b), rtol=1e-5, atol=1e-6)
