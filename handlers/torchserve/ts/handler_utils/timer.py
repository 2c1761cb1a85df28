"""`ts.handler_utils.timer.timed`: time a handler method into `ts_handler_<name>` when profiling.

As in TorchServe, the time is recorded only when the model config sets `handler: {profile: true}`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def timed(func: F) -> F:
    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        context: Any = getattr(self, "context", None)
        config = getattr(context, "model_yaml_config", None) or {}
        handler_config = config.get("handler") if isinstance(config, dict) else None
        if not (isinstance(handler_config, dict) and handler_config.get("profile")):
            return func(self, *args, **kwargs)
        start = time.perf_counter()
        result = func(self, *args, **kwargs)
        elapsed_ms = round((time.perf_counter() - start) * 1000, 2)
        context.metrics.add_time(f"ts_handler_{func.__name__}", elapsed_ms, None, "ms")
        return result

    return wrapper  # type: ignore[return-value]
