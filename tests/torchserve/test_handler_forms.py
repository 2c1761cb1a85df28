"""Each TorchServe handler form, loaded from a torch-model-archiver archive and run in-process."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from testmodels import TinyMLP, reference_output
from torchserve.tsarchives import instance, torch_model_archiver, write

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.base import BaseHandler, Context, HandlerError, InferenceRequest
from scriptserve.handlers.loader import load_handler, read_model_config


@contextmanager
def loaded(archive: Path) -> Iterator[tuple[BaseHandler, Context]]:
    with open_archive(archive) as reader:
        m = reader.manifest
        context = Context(
            m.model.model_name,
            m.model.model_version,
            reader.root,
            m,
            read_model_config(reader.root, m),
            batch_size=8,
        )
        yield load_handler(context), context


def json_requests(count: int, **headers: str) -> list[InferenceRequest]:
    return [
        InferenceRequest(
            body=json.dumps(instance(i)).encode(), content_type="application/json", headers=headers
        )
        for i in range(count)
    ]


def compatibility_layer_found() -> bool:
    """Whether `import ts` finds scriptserve's TorchServe compatibility layer (only inside
    `legacy_names`). Outside it, `ts` is nothing, or TorchServe itself where it is installed
    beside scriptserve (benchmarks/torchserve.py runs it)."""
    spec = importlib.util.find_spec("ts")
    return spec is not None and type(spec.loader).__module__.startswith("scriptserve.")


def expected(count: int) -> np.ndarray:
    return reference_output(np.asarray([instance(i) for i in range(count)], dtype=np.float32))


def test_builtin_base_handler_answers_one_row_per_request(ts_store: Path) -> None:
    with loaded(ts_store / "builtin.mar") as (handler, context):
        responses = handler.handle(json_requests(3), context)
    assert type(handler).__name__ == "TorchServe[base_handler]"
    assert np.allclose([r.body for r in responses], expected(3), atol=1e-5)
    assert not compatibility_layer_found()


def test_class_handler_gets_context_and_sets_headers(ts_store: Path) -> None:
    with loaded(ts_store / "scores.mar") as (handler, context):
        responses = handler.handle(json_requests(4, **{"x-echo": "hi"}), context)
    assert [r.body["batch"] for r in responses] == [4] * 4
    assert [r.body["max_batch"] for r in responses] == [8] * 4
    assert np.allclose([r.body["scores"] for r in responses], expected(4), atol=1e-5)
    assert [r.headers for r in responses] == [{"x-echoed": "hi"}] * 4


def test_function_module_is_initialized_with_none_and_batches(ts_store: Path) -> None:
    with loaded(ts_store / "function.mar") as (handler, context):
        responses = handler.handle(json_requests(5), context)
    labels = expected(5).argmax(axis=1).tolist()
    assert [r.body for r in responses] == [{"label": lb, "batch": 5} for lb in labels]


# The handler is TorchServe user code that calls torch.jit.load itself, as TorchServe's examples do.
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_file_colon_function_picks_that_function(ts_store: Path) -> None:
    requests = json_requests(2)
    with loaded(ts_store / "entry.mar") as (handler, context):
        responses = handler.handle(requests, context)
    assert context.manifest.model.handler == "entry_handler:predict"
    sums = expected(2).sum(axis=1)
    assert [r.body["request_id"] for r in responses] == [r.request_id for r in requests]
    assert np.allclose([r.body["sum"] for r in responses], sums, atol=1e-5)
    assert responses[0].content_type == "application/json"


def test_prediction_exception_fails_the_batch_with_its_code(ts_store: Path) -> None:
    requests = json_requests(1)
    requests.append(InferenceRequest(body=b'"fail"', content_type="application/json"))
    with loaded(ts_store / "scores.mar") as (handler, context), pytest.raises(HandlerError) as info:
        handler.handle(requests, context)
    assert (info.value.status, info.value.message) == (513, "asked to fail")


def test_a_result_list_of_the_wrong_length_fails_every_request(
    ts_sources: Path, tmp_path: Path
) -> None:
    archive = torch_model_archiver(
        ts_sources,
        tmp_path,
        "short",
        "--serialized-file",
        "tiny.pt",
        "--handler",
        "mismatch_handler.py",
    )
    with loaded(archive) as (handler, context), pytest.raises(HandlerError) as info:
        handler.handle(json_requests(3), context)
    assert info.value.message == (
        "number of batch response mismatched: the handler returned 2 results for a batch of "
        "3 requests; it must return one per request"
    )


def test_eager_model_file_loads_a_state_dict_weights_only(ts_sources: Path, tmp_path: Path) -> None:
    src = tmp_path / "eager"
    src.mkdir()
    write(
        src / "model.py",
        """
        import torch
        from torch import nn


        class TinyMLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 3)

            def forward(self, x):
                return self.fc2(torch.relu(self.fc1(x)))
    """,
    )
    torch.save(TinyMLP().state_dict(), src / "weights.pth")
    torch.save(TinyMLP(), src / "pickled.pth")
    common = ("--model-file", "model.py", "--handler", "base_handler")
    good = torch_model_archiver(src, tmp_path, "eager", "--serialized-file", "weights.pth", *common)
    bad = torch_model_archiver(
        src, tmp_path, "pickled", "--serialized-file", "pickled.pth", *common
    )

    with loaded(good) as (handler, context):
        responses = handler.handle(json_requests(2), context)
    assert np.allclose([r.body for r in responses], expected(2), atol=1e-5)

    with open_archive(bad) as reader, pytest.raises(HandlerError) as info:
        m = reader.manifest
        load_handler(Context(m.model.model_name, "1.0", reader.root, m))
    assert "pickled.pth is not a plain state_dict of tensors" in info.value.message
    assert "weights_only=True" in info.value.message


def test_ts_is_importable_only_inside_the_scope() -> None:
    from scriptserve.handlers.legacy_names import legacy_names

    assert not compatibility_layer_found()
    with legacy_names():
        from ts.utils.util import PredictionException

        assert compatibility_layer_found()
        with pytest.raises(ModuleNotFoundError, match="compatibility layer"):
            import ts.not_a_module  # noqa: F401
    assert not compatibility_layer_found()
    assert PredictionException("x", 418).error_code == 418


def test_the_packages_scriptserve_installs_hold_no_top_level_ts() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[2]
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    assert "scriptserve.handlers.torchserve.ts.torch_handler" in packages
    assert all(p == "scriptserve" or p.startswith("scriptserve.") for p in packages)
