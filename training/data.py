"""The digits data: scikit-learn's 1,797 real 8x8 handwritten digits, split, upsampled, loaded.

Every image goes through the same steps a served PNG goes through in the `image_classifier`
handler: 8-bit grayscale (ink bright, as in MNIST), bilinear resize to 32x32 with Pillow, scale
to [0, 1], normalize with the recorded mean and std. So the digits PNGs written by
`scripts/digit_images.py` are classified exactly as the test split was.

>>> splits = load_splits(seed=0)
>>> splits.train.images.shape, splits.train.images.dtype
((1258, 1, 32, 32), torch.float32)
>>> loader = make_loader(DigitsDataset(splits.train), batch_size=64, seed=0)
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    get_worker_info,
)

IMAGE_SIZE = 32
# Mean and std of the training images after scaling to [0, 1] (fixed, so that the archive's
# preprocessing does not depend on the split's seed).
MEAN = 0.3059
STD = 0.3241
CLASS_NAMES = tuple(str(d) for d in range(10))
SPLIT_FRACTIONS = (0.70, 0.15, 0.15)  # train / validation / test


@dataclass(frozen=True)
class Split:
    """One split: normalized model inputs (N, 1, 32, 32), labels (N,), and the 8-bit 8x8 images."""

    images: torch.Tensor
    labels: torch.Tensor
    raw: np.ndarray  # uint8 (N, 8, 8): what `scripts/digit_images.py` writes as PNG

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class Splits:
    train: Split
    validation: Split
    test: Split


def to_uint8(images: np.ndarray) -> np.ndarray:
    """sklearn's 0..16 intensities as 8-bit grayscale, ink bright."""
    return np.rint(images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)


def preprocess_uint8(raw: np.ndarray) -> torch.Tensor:
    """(N, h, w) uint8 -> (N, 1, 32, 32) normalized float32, as the served handler does it."""
    from PIL import Image

    out = np.empty((len(raw), 1, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    for i, image in enumerate(raw):
        resized = Image.fromarray(image, mode="L").resize(
            (IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR
        )
        out[i, 0] = np.asarray(resized, dtype=np.float32) / 255.0
    return torch.from_numpy((out - MEAN) / STD)


def preprocessing_config() -> dict[str, Any]:
    """What the archive records for the `image_classifier` handler (preprocessing.json)."""
    return {
        "grayscale": True,
        "invert": False,
        "resize": [IMAGE_SIZE, IMAGE_SIZE],
        "resample": "bilinear",
        "scale": 1.0 / 255.0,
        "mean": [MEAN],
        "std": [STD],
        "input": "x",
    }


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")
"""Where scikit-learn keeps the digits, under its package: 1,797 rows of 64 pixels and a label."""


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits as 8x8 images of 0..16 intensities (float64) and their labels: what
    `sklearn.datasets.load_digits` gives, read from scikit-learn's own file without importing
    scikit-learn, which imports SciPy: seconds of CPU in every process that trains, each
    rank of a torchrun among them. Where the file is not (another layout), scikit-learn
    loads it."""
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location).joinpath(*DIGITS_FILE)
        if path.is_file():
            with gzip.open(path, "rt") as file:
                data = np.loadtxt(file, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    return digits.images, digits.target


def load_splits(seed: int = 0, limit: int | None = None) -> Splits:
    """The fixed, seeded train / validation / test split (stratified by shuffling per class).

    `limit` keeps the first `limit` training images (for quick runs); the test split is whole.
    """
    images, target = load_digits()
    raw = to_uint8(images)
    labels = target.astype(np.int64)
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[], [], []]
    for cls in range(10):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        n_train = round(len(idx) * SPLIT_FRACTIONS[0])
        n_val = round(len(idx) * SPLIT_FRACTIONS[1])
        parts[0] += idx[:n_train].tolist()
        parts[1] += idx[n_train : n_train + n_val].tolist()
        parts[2] += idx[n_train + n_val :].tolist()
    splits = []
    for part in parts:
        order = rng.permutation(np.asarray(part))
        splits.append(
            Split(preprocess_uint8(raw[order]), torch.from_numpy(labels[order]), raw[order])
        )
    train = splits[0]
    if limit is not None:
        train = Split(train.images[:limit], train.labels[:limit], train.raw[:limit])
    return Splits(train, splits[1], splits[2])


class DigitsDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style: index -> (image, label)."""

    def __init__(self, split: Split) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split.images[index], self.split.labels[index]


class DigitsStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Iterable-style: streams a shuffled epoch, sharded across DDP ranks and loader workers.

    Like DistributedSampler, the epoch's order depends only on (seed, epoch), and it is padded by
    repeating its start so that every rank gets ceil(N / world_size) samples (DDP needs the same
    number of steps on every rank). Rank r takes every world_size-th sample from r; a rank's
    DataLoader worker w of W takes every W-th of those from w. Call `set_epoch` before iterating.
    """

    def __init__(
        self,
        split: Split,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        self.split = split
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def per_rank(self) -> int:
        return math.ceil(len(self.split) / self.world_size)

    def indices(self, worker_id: int = 0, num_workers: int = 1) -> list[int]:
        n = len(self.split)
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=gen).tolist()
        else:
            order = list(range(n))
        total = self.per_rank() * self.world_size
        order += order[: total - n]
        mine = order[self.rank : total : self.world_size]
        return mine[worker_id::num_workers]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        for i in self.indices(worker_id, num_workers):
            yield self.split.images[i], self.split.labels[i]


def make_loader(
    dataset: DigitsDataset | DigitsStream,
    batch_size: int = 64,
    seed: int = 0,
    *,
    shuffle: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """A DataLoader over either dataset kind; a map-style one gets a DistributedSampler.

    The sampler is used even in one process (world_size 1) so that the shuffle order depends on
    (seed, epoch) alone, and a resumed run sees the same batches as an uninterrupted one. Call
    `set_loader_epoch(loader, epoch)` at the start of every epoch.
    """
    sampler: DistributedSampler[Any] | None = None
    if isinstance(dataset, DigitsDataset):
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
        )
    else:
        dataset.rank, dataset.world_size, dataset.seed = rank, world_size, seed
        dataset.shuffle = shuffle
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,  # workers copy the dataset each epoch, so set_epoch reaches them
    )


def set_loader_epoch(loader: DataLoader[Any], epoch: int) -> None:
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    elif isinstance(loader.dataset, DigitsStream):
        loader.dataset.set_epoch(epoch)
