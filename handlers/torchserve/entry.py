"""Recognise TorchServe handlers and wrap them as `TorchServeHandler` classes.

TorchServe's model loader takes, in order: a module function named by `file.py:function` (or a
module-level `handle`), else the one handler class of the module. Built-in names map to the
compatibility layer's `ts.torch_handler` modules.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

from scriptserve.archiver.manifest import Manifest
from scriptserve.handlers.base import BaseHandler, HandlerError
from scriptserve.handlers.torchserve.adapter import EntryPoint, TorchServeHandler

_TS_HANDLERS = "scriptserve.handlers.torchserve.ts.torch_handler"
BUILTINS: dict[str, str] = {
    "base_handler": f"{_TS_HANDLERS}.base_handler:BaseHandler",
    "image_classifier": f"{_TS_HANDLERS}.image_classifier:ImageClassifier",
    "text_classifier": f"{_TS_HANDLERS}.text_classifier:TextClassifier",
}


def made_by_torchserve(manifest: Manifest | None) -> bool:
    """An archive from `torch-model-archiver`: its manifest has no scriptserve section."""
    return manifest is not None and manifest.scriptserve is None


def adapter_for(
    entry: EntryPoint, batching: bool = True, explains: bool = False
) -> type[BaseHandler]:
    name = f"TorchServe[{entry.description}]"
    attrs: dict[str, Any] = {"entry": entry, "supports_batching": batching, "explains": explains}
    return type(name, (TorchServeHandler,), attrs)


def _explains(cls: type) -> bool:
    """A handler class with an `explain_handle` of its own; the base handler's needs Captum,
    which the compatibility layer does not provide."""
    from scriptserve.handlers.torchserve.ts.torch_handler.base_handler import (
        BaseHandler as TsBaseHandler,
    )

    explain_handle = getattr(cls, "explain_handle", None)
    return callable(explain_handle) and explain_handle is not TsBaseHandler.explain_handle


def _class_entry(cls: type, description: str) -> type[BaseHandler]:
    # TorchServe's own BaseHandler is abstract in name only; the built-in is usable as it is.
    batching = bool(getattr(cls, "supports_batching", True))
    return adapter_for(EntryPoint(description, handler_class=cls), batching, _explains(cls))


def builtin_handler(name: str) -> type[BaseHandler] | None:
    """The adapter for a TorchServe built-in handler name, or None for another name."""
    target = BUILTINS.get(name)
    if target is None:
        return None
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    return _class_entry(cls, name)


def handler_for(module: ModuleType, filename: str, attr: str | None) -> type[BaseHandler] | None:
    """The adapter for a TorchServe-style handler module, or None when it is not one."""
    if attr:
        found = getattr(module, attr, None)
        if inspect.isclass(found) and callable(getattr(found, "handle", None)):
            return _class_entry(found, f"{filename}:{attr}")
        if inspect.isfunction(found):
            return adapter_for(EntryPoint(f"{filename}:{attr}", function=found))
        return None
    function = getattr(module, "handle", None)
    if inspect.isfunction(function):
        return adapter_for(EntryPoint(f"{filename}:handle", function=function))
    classes = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and callable(getattr(cls, "handle", None))
    ]
    if len(classes) > 1:
        names = ", ".join(c.__name__ for c in classes)
        raise HandlerError(
            f"{filename} defines {len(classes)} handler classes ({names}); TorchServe needs "
            f"exactly one: keep one, or name it as {filename}:ClassName"
        )
    if classes:
        return _class_entry(classes[0], f"{filename}:{classes[0].__name__}")
    return None
