"""Run TorchServe handlers unmodified: the `ts` import surface and an adapter to our handler API.

TorchServe handlers import `ts.torch_handler.base_handler`, `ts.utils.util` and friends. Those
modules live here, under `handlers.torchserve.ts`, and are visible as the top-level `ts` package
only inside `scriptserve.handlers.legacy_names()`: while a TorchServe handler is imported,
initialized or run.
Installing scriptserve never installs a top-level `ts` package, so a real TorchServe install
beside it is left alone.

`TorchServeHandler` (adapter.py) wraps a TorchServe entry point (a class with `handle`, or a
`handle(data, context)` function) as one of our `BaseHandler`s; `handlers.loader` builds it when
an archive's handler is TorchServe-style. See docs/migrating-from-torchserve.md.
"""

from __future__ import annotations
