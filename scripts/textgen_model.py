"""Write the streaming demo model: a next-byte model (the last 16 bytes -> logits over the 256
byte values) fitted in a few seconds to a paragraph about serving, as a state dict, and a sample
input of 16 token ids.

python scripts/textgen_model.py OUT_DIR   # writes OUT_DIR/textgen-weights.pt, textgen-sample.json

`make demo-textgen` then exports and compiles it into a `.pt2` archive served by the builtin
`text_generator` handler, which streams its answer a byte at a time:
model-archiver --export-pt2 --model-file scripts/textgen_model.py --model-class ByteLM ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

WINDOW = 16
TEXT = (
    "serving a model means taking a trained network and answering requests with it, fast, "
    "safely and observably. a good server batches requests together, bounds what a client may "
    "send, streams long answers as they are made and keeps every model apart from the others. "
)


class ByteLM(nn.Module):
    """The last WINDOW byte ids ([batch, WINDOW] int64) -> next-byte logits ([batch, 256])."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 24)
        self.hidden = nn.Sequential(nn.Linear(WINDOW * 24, 256), nn.ReLU())
        self.out = nn.Linear(256, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(self.embed(tokens).flatten(1)))


def fitted(steps: int = 400) -> ByteLM:
    """ByteLM fitted to TEXT, which it then continues from any of its windows."""
    torch.manual_seed(0)
    model = ByteLM()
    data = list((TEXT * 2).encode())
    padded = [0] * WINDOW + data
    windows = torch.tensor([padded[i : i + WINDOW] for i in range(len(data))])
    targets = torch.tensor(data)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(windows), targets).backward()
        optimizer.step()
    return model.eval()


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.save(fitted().state_dict(), out / "textgen-weights.pt")
    sample = list(b"serving a model ")[-WINDOW:]
    (out / "textgen-sample.json").write_text(json.dumps(sample))
    print(out / "textgen-weights.pt")


if __name__ == "__main__":
    main()
