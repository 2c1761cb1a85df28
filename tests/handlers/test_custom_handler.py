"""Handlers shipped as .py files inside an archive: found, chosen, isolated, and checked."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import ArchiveFactory, reference_output

from scriptserve.archiver.archive import ArchiveReader, open_archive
from scriptserve.handlers.base import BaseHandler, Context, HandlerError, InferenceRequest
from scriptserve.handlers.loader import handler_class, load_handler, read_model_config

# Labels each row with its argmax; the "handled_by" tag proves which class ran.
ARGMAX_HANDLER = """
import numpy as np

from scriptserve.handlers.base import BaseHandler, InferenceResponse


class {name}(BaseHandler):
    tag = "{tag}"

    def preprocess(self, requests):
        return {{"x": np.concatenate([r.inputs["x"] for r in requests])}}

    def postprocess(self, outputs):
        (scores,) = outputs.values()
        return [
            InferenceResponse(body={{"handled_by": self.tag, "label": int(row.argmax())}})
            for row in scores
        ]
"""


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def argmax_handler(name: str = "ArgmaxHandler", tag: str = "argmax") -> str:
    return ARGMAX_HANDLER.format(name=name, tag=tag)


def context_for(reader: ArchiveReader) -> Context:
    manifest = reader.manifest
    return Context(
        model_name=manifest.model.model_name,
        model_version=manifest.model.model_version,
        model_dir=reader.root,
        manifest=manifest,
        model_config=read_model_config(reader.root, manifest),
    )


@contextmanager
def loaded(archive: Path) -> Iterator[tuple[BaseHandler, Context]]:
    """The archive's handler, initialized the way a worker does it."""
    with open_archive(archive) as reader:
        context = context_for(reader)
        yield load_handler(context), context


def load_error(archive: Path) -> str:
    """The message of the HandlerError that loading the archive's handler raises."""
    with open_archive(archive) as reader, pytest.raises(HandlerError) as info:
        load_handler(context_for(reader))
    return info.value.message


def one_row_requests(count: int) -> tuple[list[InferenceRequest], np.ndarray]:
    x = np.random.default_rng(count).standard_normal((count, 8)).astype(np.float32)
    return [InferenceRequest(inputs={"x": x[i : i + 1]}) for i in range(count)], x


def expected_labels(x: np.ndarray) -> list[int]:
    return [int(label) for label in reference_output(x).argmax(axis=1)]


def test_custom_handler_in_the_archive_is_used(
    tmp_path: Path, onnx_file: Path, make_archive: ArchiveFactory
) -> None:
    handler_file = write(tmp_path / "src" / "argmax_handler.py", argmax_handler())
    requests, x = one_row_requests(4)

    with loaded(make_archive(onnx_file, handler=str(handler_file))) as (handler, context):
        responses = handler.handle(requests, context)

    assert type(handler).__name__ == "ArgmaxHandler"
    assert [r.body["handled_by"] for r in responses] == ["argmax"] * 4
    assert [r.body["label"] for r in responses] == expected_labels(x)


def test_file_and_class_name_picks_one_of_two_classes(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    source = argmax_handler("First", "first") + argmax_handler("Second", "second")
    handler_file = write(tmp_path / "src" / "two.py", source)
    requests, x = one_row_requests(2)

    archive = make_archive(torchscript_file, handler=f"{handler_file}:Second")
    with loaded(archive) as (handler, context):
        responses = handler.handle(requests, context)

    assert context.manifest.model.handler == "two.py:Second"
    assert [r.body for r in responses] == [
        {"handled_by": "second", "label": label} for label in expected_labels(x)
    ]


def test_two_classes_and_no_name_asks_to_name_one(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    source = argmax_handler("First", "first") + argmax_handler("Second", "second")
    handler_file = write(tmp_path / "src" / "two.py", source)

    message = load_error(make_archive(torchscript_file, handler=str(handler_file)))

    assert message == (
        "two.py defines 2 BaseHandler subclasses; define exactly one, "
        "or name it as two.py:ClassName"
    )


def test_naming_a_class_the_file_lacks_is_an_error(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    handler_file = write(tmp_path / "src" / "one.py", argmax_handler())

    archive = make_archive(torchscript_file, handler=f"{handler_file}:Missing")
    assert load_error(archive) == "one.py has no BaseHandler subclass named 'Missing'"


def test_a_handler_file_that_fails_to_import_is_named(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    handler_file = write(
        tmp_path / "src" / "broken_handler.py",
        "import a_dependency_nobody_installed  # noqa\n" + argmax_handler(),
    )
    archive = make_archive(torchscript_file, handler=str(handler_file))

    message = load_error(archive)

    assert message.startswith("handler file 'broken_handler.py' failed to import: ")
    assert "No module named 'a_dependency_nobody_installed'" in message


def test_postprocess_with_the_wrong_number_of_results_is_an_error(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    source = argmax_handler("Short", "short") + textwrap.dedent(
        """
        class DropsOne(Short):
            def postprocess(self, outputs):
                return super().postprocess(outputs)[:-1]
        """
    )
    handler_file = write(tmp_path / "src" / "short.py", source)
    requests, _ = one_row_requests(3)

    archive = make_archive(torchscript_file, handler=f"{handler_file}:DropsOne")
    with loaded(archive) as (handler, context), pytest.raises(HandlerError) as info:
        handler.handle(requests, context)

    assert info.value.message == (
        "DropsOne.postprocess returned 2 results for a batch of 3 requests; "
        "it must return a list with one result per request"
    )


def test_supports_batching_false_is_readable_on_the_class(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    source = """
        from scriptserve.handlers.base import BaseHandler


        class OneAtATime(BaseHandler):
            supports_batching = False
    """
    handler_file = write(tmp_path / "src" / "single.py", source)

    archive = make_archive(torchscript_file, handler=str(handler_file))
    with open_archive(archive) as reader:
        cls = handler_class(reader.manifest.model.handler, reader.root)

    assert cls.__name__ == "OneAtATime"
    assert cls.supports_batching is False
    assert BaseHandler.supports_batching is True


def test_handler_imports_a_helper_module_shipped_beside_it(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    helper = write(tmp_path / "src" / "label_names_7f3a.py", 'LABELS = ("cat", "dog", "bird")\n')
    source = "from label_names_7f3a import LABELS\n" + argmax_handler("Named", "named")
    source += textwrap.dedent(
        """
        class WithNames(Named):
            def postprocess(self, outputs):
                results = super().postprocess(outputs)
                for r in results:
                    r.body["name"] = LABELS[r.body["label"]]
                return results
        """
    )
    handler_file = write(tmp_path / "src" / "named.py", source)
    requests, x = one_row_requests(3)

    archive = make_archive(
        torchscript_file,
        handler=f"{handler_file}:WithNames",
        extra=["--extra-files", str(helper)],
    )
    with loaded(archive) as (handler, context):
        responses = handler.handle(requests, context)

    names = ("cat", "dog", "bird")
    assert [r.body["name"] for r in responses] == [names[i] for i in expected_labels(x)]


def test_two_archives_with_a_handler_py_each_do_not_collide(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    first = write(tmp_path / "a" / "handler.py", argmax_handler("Handler", "from archive a"))
    second = write(tmp_path / "b" / "handler.py", argmax_handler("Handler", "from archive b"))
    requests, _ = one_row_requests(1)

    with (
        loaded(make_archive(torchscript_file, name="a", handler=str(first))) as (ha, ca),
        loaded(make_archive(torchscript_file, name="b", handler=str(second))) as (hb, cb),
    ):
        (ra,) = ha.handle(requests, ca)
        (rb,) = hb.handle(requests, cb)

    assert ra.body["handled_by"] == "from archive a"
    assert rb.body["handled_by"] == "from archive b"
    assert type(ha) is not type(hb)


def test_a_rebuilt_directory_archive_loads_its_new_handler(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    # A `no-archive` model is used in place, so a rebuild lands at the same path as before.
    handler_file = tmp_path / "src" / "handler.py"
    requests, _ = one_row_requests(1)
    tags = []
    for tag in ("version 1", "version 2"):
        write(handler_file, argmax_handler("Handler", tag))
        archive = make_archive(
            torchscript_file, name="inplace", fmt="no-archive", handler=str(handler_file)
        )
        with loaded(archive) as (handler, context):
            (response,) = handler.handle(requests, context)
        tags.append(response.body["handled_by"])

    assert tags == ["version 1", "version 2"]


def test_two_archives_with_a_helper_of_the_same_name_each_get_their_own(
    tmp_path: Path, torchscript_file: Path, make_archive: ArchiveFactory
) -> None:
    source = "import labels_4c1d\n" + argmax_handler("Tagged", "unused")
    source += textwrap.dedent(
        """
        class WithHelperTag(Tagged):
            def postprocess(self, outputs):
                results = super().postprocess(outputs)
                for r in results:
                    r.body["handled_by"] = labels_4c1d.TAG
                return results
        """
    )
    requests, _ = one_row_requests(1)
    tags = []
    for name in ("first", "second"):
        helper = write(tmp_path / name / "labels_4c1d.py", f"TAG = {name!r}\n")
        handler_file = write(tmp_path / name / "handler.py", source)
        archive = make_archive(
            torchscript_file,
            name=name,
            handler=f"{handler_file}:WithHelperTag",
            extra=["--extra-files", str(helper)],
        )
        with loaded(archive) as (handler, context):
            (response,) = handler.handle(requests, context)
        tags.append(response.body["handled_by"])

    assert tags == ["first", "second"]
