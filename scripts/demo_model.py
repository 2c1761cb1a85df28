"""Write the demo model: a small MLP (16 -> 32 -> 4, softmax) as a state dict, and a sample input.

python scripts/demo_model.py OUT_DIR   # writes OUT_DIR/demo-weights.pt and OUT_DIR/sample.json

`make demo-archive` then exports and compiles it into a `.pt2` archive:
model-archiver --export-pt2 --model-file scripts/demo_model.py --model-class DemoMLP ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn


class DemoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.layers(x), dim=1)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(DemoMLP().state_dict(), out / "demo-weights.pt")
    (out / "sample.json").write_text(json.dumps([round(0.1 * i, 1) for i in range(16)]))
    print(out / "demo-weights.pt")


if __name__ == "__main__":
    main()
