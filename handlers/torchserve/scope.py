"""`torchserve_scope()`: the `ts` package is importable inside it, and gone outside it.

Entering puts every module of `handlers.torchserve.ts` into `sys.modules` under its TorchServe
name (`ts`, `ts.torch_handler.base_handler`, ...) and a finder in front of `sys.meta_path` that
answers any other `ts.*` import with a clear error; leaving removes both. Handlers keep the
module objects they imported, so code that ran inside the scope keeps working after it.
The scope is counted: worker threads enter and leave it around each batch, and the aliases stay
while any of them is inside.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from types import ModuleType

_PACKAGE = "handlers.torchserve.ts"
_lock = threading.Lock()
_depth = [0]  # threads inside the scope now
_installed: dict[str, ModuleType] = {}
_shadowed: dict[str, ModuleType] = {}


class _MissingTsModule:
    """Meta-path finder: a `ts.*` module the compatibility layer does not provide."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == "ts" or fullname.startswith("ts."):
            raise ModuleNotFoundError(
                f"{fullname} is not part of scriptserve's TorchServe compatibility layer "
                "(see docs/migrating-from-torchserve.md for the modules it provides)",
                name=fullname,
            )
        return None


_finder = _MissingTsModule()


def _ts_modules() -> dict[str, ModuleType]:
    """Every module of the compatibility package, by its TorchServe name."""
    root = importlib.import_module(_PACKAGE)
    modules = {"ts": root}
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{_PACKAGE}."):
        module = importlib.import_module(info.name)
        modules["ts" + info.name[len(_PACKAGE) :]] = module
    return modules


def _install() -> None:
    modules = _ts_modules()
    for name, module in modules.items():
        previous = sys.modules.get(name)
        if previous is not None and previous is not module:
            _shadowed[name] = previous
        sys.modules[name] = module
    _installed.update(modules)
    sys.meta_path.insert(0, _finder)


def _uninstall() -> None:
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name, module in _installed.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]
    _installed.clear()
    sys.modules.update(_shadowed)
    _shadowed.clear()


@contextmanager
def torchserve_scope() -> Iterator[None]:
    """`import ts...` works inside the block (and in threads while any is inside)."""
    with _lock:
        if _depth[0] == 0:
            _install()
        _depth[0] += 1
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                _uninstall()
