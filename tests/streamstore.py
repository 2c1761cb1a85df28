"""Models that answer in parts, for the streaming tests over REST (tests/server/test_streaming.py)
and gRPC (tests/server/grpc/test_streaming_grpc.py), and the server settings they run under."""

from __future__ import annotations

import json
from pathlib import Path

from scriptserve.archiver.cli import model_archiver_main

MAX_UNREAD = 64
SEND_TIMEOUT_S = 4.0
SLOW_MATMULS = 60
"""TinyLM's busy work per token for `slowlm`: about 30 ms a token on one core."""

TS_STREAMING = """
from ts.protocol.otf_message_handler import send_intermediate_predict_response


def handle(data, context):
    if data is None:
        return None
    for step in range(3):
        send_intermediate_predict_response(
            [f"part {step};" for _ in data], context.request_ids,
            "Intermediate Prediction success", 200, context,
        )
    return ["done" for _ in data]
"""

BIG_PARTS = """
from scriptserve.handlers.base import BaseHandler, InferenceResponse

PART = 65536


class BigParts(BaseHandler):
    def initialize(self, context):
        self.context = context

    def stream(self, requests):
        for step in range(400):
            yield [InferenceResponse(body=bytes([65 + step % 26]) * PART) for _ in requests]
"""


COUNTER = """
import numpy as np

from scriptserve.handlers.base import BaseHandler, InferenceResponse


class Counter(BaseHandler):
    \"\"\"Parts 0 .. count-1 (the request's `count` parameter, default 3) as output `n`, then
    an empty end: a stream whose final part carries nothing.\"\"\"

    def initialize(self, context):
        self.context = context

    def stream(self, requests):
        counts = [int(r.parameters.get("count", 3)) for r in requests]
        for step in range(max(counts)):
            yield [
                InferenceResponse(outputs={"n": np.array([step], np.int64)}, body=str(step))
                if step < count else None
                for count in counts
            ]
"""


INTERMEDIATE = """
import numpy as np

from scriptserve.handlers.base import BaseHandler, InferenceResponse
from scriptserve.handlers.parts import send_parts


class Intermediate(BaseHandler):
    \"\"\"Answers once (it does not implement `stream`), after two intermediate parts sent with
    send_parts, as a TorchServe handler's send_intermediate_predict_response does.\"\"\"

    def initialize(self, context):
        self.context = context

    def handle(self, requests, context):
        for step in range(2):
            send_parts([InferenceResponse(outputs={"n": np.array([step])}) for _ in requests])
        return [InferenceResponse(outputs={"n": np.array([2])}) for _ in requests]
"""


def archive_lm(store: Path, work: Path, name: str, model: Path, handler: str) -> None:
    sample = work / "tokens.json"
    sample.write_text(json.dumps(list(b"the quic")))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--handler", handler, "--sample-input", str(sample), "--input-dtype", "INT64",
        "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
