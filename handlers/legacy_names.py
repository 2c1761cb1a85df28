"""`legacy_names()`: the import names archived handlers use, for as long as they are used.

Handler files written for TorchServe import `ts.torch_handler.base_handler`, `ts.utils.util`
and friends; handler files written for scriptserve before it was one package import
`handlers.base`. Neither name is installed: inside `legacy_names()` a finder at the front of
`sys.meta_path` answers `ts.X` with `scriptserve.handlers.torchserve.ts.X` and `handlers.X` with
`scriptserve.handlers.X` (the same module objects, so classes compare equal), and any other
`ts.*` module with a clear error. Leaving the scope removes the finder and those `sys.modules`
entries and puts back whatever a user's own `ts` or `handlers` had there. Handlers keep the
module objects they imported, so code that ran inside the scope keeps working after it.

The scope is counted: it is entered while a handler file is imported and for the life of each
worker that runs such a handler (never per batch), and the names stay while any is inside.

>>> with legacy_names():
...     from handlers.base import BaseHandler
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from types import ModuleType

ALIASES: dict[str, str] = {
    "ts": "scriptserve.handlers.torchserve.ts",
    "handlers": "scriptserve.handlers",
}
"""Legacy top-level name -> the package that provides it."""

_lock = threading.Lock()
_entered = [0]  # scopes entered and not yet left, across threads
_shadowed: dict[str, ModuleType] = {}


def _alias_of(fullname: str) -> tuple[str, str] | None:
    for alias, package in ALIASES.items():
        if fullname == alias or fullname.startswith(alias + "."):
            return alias, package + fullname[len(alias) :]
    return None


class _Existing(importlib.abc.Loader):
    """Loads a legacy name as the module already imported under its real name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed under its real name."""


class _LegacyFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        found = _alias_of(fullname)
        if found is None:
            return None
        alias, real = found
        try:
            module = importlib.import_module(real)
        except ModuleNotFoundError as exc:
            if exc.name is None or not real.startswith(exc.name):
                raise  # a dependency of the real module is missing: say that, not this
            if alias == "ts":
                message = (
                    f"{fullname} is not part of scriptserve's TorchServe compatibility layer "
                    "(see docs/migrating-from-torchserve.md for the modules it provides)"
                )
            else:
                message = f"{fullname} is not a module of scriptserve.handlers"
            raise ModuleNotFoundError(message, name=fullname) from None
        return importlib.util.spec_from_loader(
            fullname, _Existing(module), is_package=hasattr(module, "__path__")
        )


_finder = _LegacyFinder()


def _is_legacy(name: str) -> bool:
    return _alias_of(name) is not None


def _install() -> None:
    for name in [n for n in sys.modules if _is_legacy(n)]:
        _shadowed[name] = sys.modules.pop(name)  # a user's own `handlers` or `ts`
    sys.meta_path.insert(0, _finder)


def _uninstall() -> None:
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if _is_legacy(n)]:
        del sys.modules[name]
    sys.modules.update(_shadowed)
    _shadowed.clear()


@contextmanager
def legacy_names() -> Iterator[None]:
    """`import ts...` and `import handlers...` work inside the block (and in other threads
    while any thread is inside)."""
    with _lock:
        if _entered[0] == 0:
            _install()
        _entered[0] += 1
    try:
        yield
    finally:
        with _lock:
            _entered[0] -= 1
            if _entered[0] == 0:
                _uninstall()
