from __future__ import annotations

import httpx
import numpy as np
import pytest
from serving import ServerProcess
from testmodels import reference_output

# Slow: a server started for one test.
pytestmark = pytest.mark.slow


def test_predictions_answer_the_models_output(server: ServerProcess) -> None:
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    for model in ("tiny", "tiny_onnx"):
        r = httpx.post(f"{server.url}/predictions/{model}", json=x.tolist())
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json(), reference_output(x[None])[0], atol=1e-5)
