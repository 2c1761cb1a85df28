"""What a run leaves beside its archives: a metrics JSON and a training-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_metrics(path: Path, metrics: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return path


def plot_curves(path: Path, history: list[dict[str, float]], title: str) -> Path:
    """Loss (train, validation) and accuracy (train, validation) per epoch, side by side."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file only
    import matplotlib.pyplot as plt

    epochs = [int(h["epoch"]) for h in history]
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    try:
        loss_ax.plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
        loss_ax.plot(epochs, [h["val_loss"] for h in history], marker="o", label="validation")
        loss_ax.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
        acc_ax.plot(epochs, [h["train_accuracy"] for h in history], marker="o", label="train")
        acc_ax.plot(epochs, [h["val_accuracy"] for h in history], marker="o", label="validation")
        acc_ax.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0.0, 1.0))
        for ax in (loss_ax, acc_ax):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
