"""Find, build and initialize the handler an archive asks for.

`model.handler` in the manifest is a built-in name (`tensor`) or a Python file in the archive
(`my_handler.py`, or `my_handler.py:MyHandler` to pick a class). A file must define exactly one
`BaseHandler` subclass unless the class is named.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import yaml

from scriptserve.archiver.manifest import Manifest
from scriptserve.handlers.base import BaseHandler, Context, HandlerError
from scriptserve.handlers.legacy_names import legacy_names
from scriptserve.handlers.torchserve import entry as torchserve_entry
from scriptserve.handlers.torchserve.adapter import TorchServeHandler

BUILTIN_HANDLERS: dict[str, str] = {
    "tensor": "scriptserve.handlers.tensor:TensorHandler",
    "image_classifier": "scriptserve.handlers.image_classifier:ImageClassifierHandler",
    "text_generator": "scriptserve.handlers.text_generator:TextGenerator",
    "text_classifier": "scriptserve.handlers.text_classifier:TextClassifier",
    "text_embedder": "scriptserve.handlers.text_embedder:TextEmbedder",
}


def read_model_config(root: Path, manifest: Manifest) -> dict[str, Any]:
    """The archive's model config YAML (safe_load only), or {} when it has none."""
    name = manifest.model.config_file
    if not name:
        return {}
    path = root / name
    if not path.is_file():
        raise HandlerError(f"the archive's config file {name!r} is missing")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise HandlerError(f"the archive's config file {name!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HandlerError(f"the archive's config file {name!r} must hold a mapping")
    return data


_ARCHIVE_MODULE_PREFIX = "scriptserve_handler_"
"""Module names of handler files imported from archives start with this."""


def _forget_helpers(names: set[str], model_dir: Path) -> None:
    """Drop the archive's helper modules from sys.modules; the handler keeps its references.

    Otherwise another archive's helper of the same name (a `model.py`, a `labels.py`) would be
    served this archive's cached one.
    """
    root = model_dir.resolve()
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and Path(file).resolve().is_relative_to(root):
            del sys.modules[name]


def _import_file(path: Path, model_dir: Path) -> Any:
    # A unique module name per archive file and content: two models with a handler.py must not
    # collide, and a handler rebuilt in place (a `no-archive` directory) must not be served stale.
    digest = hashlib.sha256(str(path.resolve()).encode() + path.read_bytes()).hexdigest()[:12]
    module_name = f"{_ARCHIVE_MODULE_PREFIX}{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise HandlerError(f"handler file {path.name!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    # The handler may import helper modules shipped beside it in the archive.
    before = set(sys.modules)
    sys.path.insert(0, str(model_dir))
    try:
        # TorchServe handlers import `ts`, older scriptserve handlers `handlers.base`.
        with legacy_names():
            spec.loader.exec_module(module)
    except Exception as exc:
        raise HandlerError(f"handler file {path.name!r} failed to import: {exc!r}") from None
    finally:
        sys.path.remove(str(model_dir))
        _forget_helpers(set(sys.modules) - before, model_dir)
    sys.modules[module_name] = module
    return module


def handler_class(
    handler: str, model_dir: Path, manifest: Manifest | None = None
) -> type[BaseHandler]:
    """Resolve the manifest's handler entry to a BaseHandler subclass.

    TorchServe handlers (its built-in names in archives made by torch-model-archiver, a
    `handle(data, context)` function, a class with `handle`) come wrapped in a TorchServeHandler.
    """
    # Looked up only where it may be used: TorchServe's handler modules import torch.
    if handler not in BUILTIN_HANDLERS or torchserve_entry.made_by_torchserve(manifest):
        ts_builtin = torchserve_entry.builtin_handler(handler)
        if ts_builtin is not None:
            return ts_builtin
    if handler in BUILTIN_HANDLERS:
        module_name, _, attr = BUILTIN_HANDLERS[handler].partition(":")
        cls: type[BaseHandler] = getattr(importlib.import_module(module_name), attr)
        return cls
    filename, _, attr = handler.partition(":")
    if not filename.endswith(".py"):
        filename += ".py"
    path = model_dir / Path(filename).name
    if not path.is_file():
        known = ", ".join(BUILTIN_HANDLERS)
        raise HandlerError(
            f"handler {handler!r} is neither a built-in ({known}) nor a file in the archive"
        )
    module = _import_file(path, model_dir)
    if attr:
        found = getattr(module, attr, None)
        if not (inspect.isclass(found) and issubclass(found, BaseHandler)):
            wrapped = torchserve_entry.handler_for(module, filename, attr)
            if wrapped is not None:
                return wrapped
            raise HandlerError(f"{filename} has no BaseHandler subclass named {attr!r}")
        return found
    classes = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, BaseHandler) and c.__module__ == module.__name__
    ]
    if not classes:
        wrapped = torchserve_entry.handler_for(module, filename, None)
        if wrapped is not None:
            return wrapped
    if len(classes) != 1:
        raise HandlerError(
            f"{filename} defines {len(classes)} BaseHandler subclasses; define exactly one, "
            f"or name it as {filename}:ClassName"
        )
    return classes[0]


def load_handler(context: Context) -> BaseHandler:
    """Build the archive's handler and initialize it for `context`."""
    cls = handler_class(context.manifest.model.handler, context.model_dir, context.manifest)
    handler = cls()
    handler.initialize(context)
    return handler


def worker_scope(handler: BaseHandler) -> AbstractContextManager[None]:
    """What a worker holds open for its whole life while it runs `handler`: the legacy import
    names (`ts`, `handlers`) for handlers from archive files and TorchServe entry points, which
    may import them lazily; nothing for the built-in handlers."""
    from_archive = type(handler).__module__.startswith(_ARCHIVE_MODULE_PREFIX)
    if from_archive or isinstance(handler, TorchServeHandler):
        return legacy_names()
    return nullcontext()
