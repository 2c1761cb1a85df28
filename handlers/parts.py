"""Where a streaming handler's parts go: the sink of the batch a worker thread is running.

A worker names the sink of each batch it runs (`base.run_batch` does, with `set_sink`); the
steps of a handler's `stream`, and code that sends parts itself (TorchServe's
`send_intermediate_predict_response`), reach it through `send_parts` from the same thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scriptserve.handlers.base import InferenceResponse


class PartSink(Protocol):
    """Where the parts a streaming handler yields go: the worker's link to each client."""

    def send(self, parts: Sequence[InferenceResponse | None]) -> None:
        """Deliver one step's parts, one per request of the batch (None: no part for it);
        raises StreamClosed when no request of the batch still listens."""


class DiscardParts:
    """The sink of a batch nobody streams from (warm-up): parts are dropped."""

    def send(self, parts: Sequence[InferenceResponse | None]) -> None:
        return None


_sinks = threading.local()


def set_sink(sink: PartSink | None) -> None:
    """Parts sent from this thread go to `sink` from now on (None: they are dropped)."""
    _sinks.sink = sink


def send_parts(parts: Sequence[InferenceResponse | None]) -> None:
    """Send one step's parts for the batch this thread is running (see `PartSink.send`)."""
    sink: PartSink = getattr(_sinks, "sink", None) or DiscardParts()
    sink.send(parts)
