"""`ts.protocol.otf_message_handler`: the part of TorchServe's backend protocol handlers call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scriptserve.handlers.torchserve.adapter import send_intermediate


def send_intermediate_predict_response(
    ret: list[Any], req_id_map: Mapping[int, str], message: str, code: int, context: Any = None
) -> None:
    """Send one intermediate result per request of the batch (`ret[i]` for request i) to each
    client now, as TorchServe's streaming handlers do; what `handle` returns ends each stream.
    `message` is TorchServe's log text and is not sent."""
    send_intermediate(ret, req_id_map, code, context)
