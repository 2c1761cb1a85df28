"""Fixtures for the chaos tests: a slow model whose handler logs every item it runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hardening import archive

SLOW_HANDLER = """
import json
import os
import time

from scriptserve.handlers.tensor import TensorHandler


class SlowHandler(TensorHandler):
    def preprocess(self, requests):
        # The first value of each /predictions body names the request; it is logged as it runs.
        with open(os.environ["RUN_LOG"], "a") as log:
            for request in requests:
                log.write(f"{json.loads(request.body)[0]:g}\\n")
        time.sleep(float(os.environ.get("SLEEP_S", "1.0")))
        return super().preprocess(requests)
"""


@pytest.fixture(scope="module")
def slow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chaos")
    handler = root / "slow_handler.py"
    handler.write_text(textwrap.dedent(SLOW_HANDLER))
    store = root / "store"
    archive(store, root / "work", "slow", handler=str(handler), config={"batchSize": 1})
    archive(store, root / "work", "tiny")
    return store
