"""The models the training module knows, by name.

>>> model = build_model("lenet")
>>> model(torch.zeros(2, 1, 32, 32)).shape
torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """The classic LeNet-style net: conv 6 -> conv 16 (5x5, 2x2 max-pool), fc 120 -> 84 -> 10."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        out: torch.Tensor = self.fc3(x)
        return out


class MLP(nn.Module):
    """A two-hidden-layer perceptron on the flattened 32x32 image."""

    def __init__(self, num_classes: int = 10, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32 * 32, hidden)
        self.fc2 = nn.Linear(hidden, hidden // 2)
        self.fc3 = nn.Linear(hidden // 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        out: torch.Tensor = self.fc3(x)
        return out


MODELS: dict[str, Callable[[], nn.Module]] = {"lenet": Net, "mlp": MLP}


def build_model(name: str) -> nn.Module:
    """A freshly initialized model from the registry (seed torch first for repeatable weights)."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
