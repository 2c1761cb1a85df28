"""One epoch of training and one pass of evaluation, with AMP, anomaly detection and profiling.

AMP is bf16 autocast on the CPU and fp16 autocast with a GradScaler on CUDA (bf16 has fp32's
range, so it needs no loss scaling; fp16 does).

>>> amp = AmpPolicy.for_device(torch.device("cpu"), enabled=True)
>>> stats = train_epoch(model, loader, optimizer, amp, device, epoch=1)
>>> evaluate(model, loader, device, amp).accuracy
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from scriptserve.training.distributed import DistInfo, all_reduce_sum

log = logging.getLogger("training")

Batches = DataLoader[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AmpPolicy:
    """Whether and how to autocast; `scaler` is enabled only for fp16 on CUDA."""

    enabled: bool
    device_type: str
    dtype: torch.dtype
    scaler: torch.amp.GradScaler

    @classmethod
    def for_device(cls, device: torch.device, enabled: bool) -> AmpPolicy:
        cuda = device.type == "cuda"
        dtype = torch.float16 if cuda else torch.bfloat16
        scaler = torch.amp.GradScaler("cuda" if cuda else "cpu", enabled=enabled and cuda)
        return cls(enabled, device.type, dtype, scaler)

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


@dataclass(frozen=True)
class EpochStats:
    loss: float
    accuracy: float
    samples: int


def make_optimizer(
    name: str, params: Any, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adamw")


@contextlib.contextmanager
def profiling(enabled: bool, trace_dir: Path | None) -> Iterator[torch.profiler.profile | None]:
    """The torch profiler over a block; logs the top operators and writes a Chrome trace."""
    if not enabled:
        yield None
        return
    with torch.profiler.profile(record_shapes=False) as prof:
        yield prof
    log.info(
        "profile (top operators by self CPU time):\n%s",
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    )
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / "trace.json"))


def _progress(loader: Batches, enabled: bool, desc: str) -> Any:
    if not enabled:
        return loader
    from tqdm import tqdm

    return tqdm(loader, desc=desc, leave=False, unit="batch", dynamic_ncols=True)


def train_epoch(
    model: nn.Module,
    loader: Batches,
    optimizer: torch.optim.Optimizer,
    amp: AmpPolicy,
    device: torch.device,
    epoch: int,
    *,
    info: DistInfo | None = None,
    detect_anomaly: bool = False,
    progress: bool = False,
) -> EpochStats:
    """zero_grad / backward / step over the loader; loss and accuracy summed over all ranks."""
    model.train()
    criterion = nn.CrossEntropyLoss()
    non_blocking = device.type == "cuda"
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
    anomaly = torch.autograd.detect_anomaly() if detect_anomaly else contextlib.nullcontext()
    with anomaly:
        for batch_images, batch_labels in _progress(loader, progress, f"epoch {epoch}"):
            images = batch_images.to(device, non_blocking=non_blocking)
            labels = batch_labels.to(device, non_blocking=non_blocking)
            optimizer.zero_grad(set_to_none=True)
            with amp.autocast():
                logits = model(images)
                loss = criterion(logits, labels)
            amp.scaler.scale(loss).backward()
            amp.scaler.step(optimizer)
            amp.scaler.update()
            n = labels.shape[0]
            totals += torch.tensor(
                [loss.item() * n, (logits.argmax(1) == labels).sum().item(), n],
                dtype=torch.float64,
            )
    all_reduce_sum(totals, info or DistInfo())
    return EpochStats(
        totals[0].item() / totals[2].item(),
        totals[1].item() / totals[2].item(),
        int(totals[2].item()),
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Batches, device: torch.device, amp: AmpPolicy | None = None
) -> EpochStats:
    """Loss and accuracy of `model` over every batch of `loader` (this process only)."""
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss_sum, correct, seen = 0.0, 0, 0
    autocast = amp.autocast() if amp is not None else contextlib.nullcontext()
    with autocast:
        for batch_images, batch_labels in loader:
            images, labels = batch_images.to(device), batch_labels.to(device)
            logits = model(images).float()
            loss_sum += criterion(logits, labels).item()
            correct += int((logits.argmax(1) == labels).sum().item())
            seen += int(labels.shape[0])
    return EpochStats(loss_sum / max(seen, 1), correct / max(seen, 1), seen)
