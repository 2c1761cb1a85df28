"""`ts.handler_utils.utils`: where TorchServe 0.8+ handlers import the streaming call from."""

from __future__ import annotations

from ..protocol.otf_message_handler import send_intermediate_predict_response

__all__ = ["send_intermediate_predict_response"]
