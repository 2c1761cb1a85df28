"""A whole training run: data, model, epochs with checkpoints, then export and archives.

Run in one process, or under `torchrun` (DistributedDataParallel, or FSDP2 with
`strategy="fsdp"`: see strategy.py; gloo on CPU, NCCL on GPU). Every rank trains; rank 0 alone
writes archives, metrics, plots and DDP's `last.pt`; every rank writes its shards of an FSDP
run's checkpoint (sharded_checkpoint.py), which resumes on any number of ranks. A run restarted
by torchrun's elastic agent (`--max-restarts`), or started with `resume=True`, continues from
the last checkpoint. The shuffle order depends only on (seed, epoch), so a resumed run sees the
batches an uninterrupted one would have seen.

>>> result = train(TrainConfig(model="lenet", epochs=10, out=Path("model_store")))
>>> result.archives
[PosixPath('model_store/digits.mar'), PosixPath('model_store/digits-onnx.mar')]
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from scriptserve.training import data
from scriptserve.training.archives import ArchiveContents, build_model_archive, write_support_files
from scriptserve.training.checkpoint import (
    restore_training,
    rng_state,
    save_training,
    set_rng_state,
)
from scriptserve.training.distributed import (
    DistInfo,
    barrier,
    destroy_process_group,
    dist_info,
    init_process_group,
    select_device,
)
from scriptserve.training.export import (
    DEFAULT_FORMATS,
    FORMATS,
    Exported,
    ExportError,
    export_onnx,
    export_pt2,
    export_pt2_int8,
    export_torchscript,
    export_torchscript_int8,
    export_traced,
    runner_for,
)
from scriptserve.training.loop import evaluate, make_optimizer, profiling, train_epoch
from scriptserve.training.models import build_model
from scriptserve.training.qat import QatModel, QatSettings, finetune
from scriptserve.training.qat import export_int8 as export_qat_int8
from scriptserve.training.report import plot_curves, write_metrics
from scriptserve.training.strategy import (
    STRATEGIES,
    Parallelism,
    parallelize,
    parameter_share,
    precision,
    unsharded_copy,
    unwrap,
)

if TYPE_CHECKING:
    from torch.export import ExportedProgram

log = logging.getLogger("training")


class SimulatedFailure(RuntimeError):
    """Raised by `fail_once_at_epoch` to exercise torchrun's restart and resume."""


@dataclass(frozen=True)
class TrainConfig:
    model: str = "lenet"
    name: str = "digits"
    epochs: int = 10
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    split_seed: int = 0
    amp: bool = False
    device: str = "auto"
    strategy: str = "ddp"  # or "fsdp"
    cpu_offload: bool = False  # FSDP only: shards, gradients and optimizer step on the CPU
    num_workers: int = 0
    streaming: bool = False
    train_limit: int | None = None
    formats: tuple[str, ...] = DEFAULT_FORMATS
    out: Path = Path("model_store")
    work_dir: Path | None = None
    resume: bool = False
    detect_anomaly: bool = False
    profile: bool = False
    progress: bool | None = None  # None: when stderr is a terminal
    stop_after_epoch: int | None = None
    fail_once_at_epoch: int | None = None
    digest_dir: Path | None = None
    version: str = "1.0"
    qat: bool = False  # fine-tune with fake int8 quantization; pt2-int8 is then made from it
    qat_epochs: int = 3
    qat_lr: float | None = None  # None: lr / 10

    def qat_settings(self) -> QatSettings:
        lr = self.qat_lr if self.qat_lr is not None else self.lr / 10
        return QatSettings(
            epochs=self.qat_epochs,
            lr=lr,
            optimizer=self.optimizer,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            batch_size=self.batch_size,
            seed=self.seed,
        )

    @property
    def run_dir(self) -> Path:
        """Checkpoints, metrics, plots: `<out>/<name>-training/` unless given."""
        return self.work_dir or self.out / f"{self.name}-training"

    def check(self) -> None:
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown:
            raise ValueError(f"unknown format(s) {unknown}; choose from {', '.join(FORMATS)}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("epochs and batch size must be at least 1")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose ddp or fsdp")
        if self.cpu_offload and self.strategy != "fsdp":
            raise ValueError("CPU offload shards the model: use it with strategy fsdp")
        if self.qat and ("pt2-int8" not in self.formats or self.qat_epochs < 1):
            raise ValueError(
                "QAT makes the pt2-int8 archive: add pt2-int8 to the formats and "
                "give at least 1 QAT epoch"
            )


@dataclass
class TrainResult:
    metrics: dict[str, Any]
    history: list[dict[str, float]]
    archives: list[Path] = field(default_factory=list)
    epochs_run: int = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer, in state_dict order."""
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(config: TrainConfig) -> TrainResult:
    config.check()
    info = dist_info()
    device = select_device(info, config.device)
    init_process_group(info, device)
    try:
        return _train(config, info, device)
    finally:
        destroy_process_group()


def _train(  # noqa: PLR0915  (one run, start to end, reads best in one place)
    config: TrainConfig, info: DistInfo, device: torch.device
) -> TrainResult:
    seed_everything(config.seed)
    splits = data.load_splits(config.split_seed, config.train_limit)
    dataset: data.DigitsDataset | data.DigitsStream = (
        data.DigitsStream(splits.train) if config.streaming else data.DigitsDataset(splits.train)
    )
    cuda = device.type == "cuda"
    loader = data.make_loader(
        dataset,
        config.batch_size,
        config.seed,
        num_workers=config.num_workers,
        pin_memory=cuda,
        rank=info.rank,
        world_size=info.world_size,
    )
    val_loader = data.make_loader(
        data.DigitsDataset(splits.validation), 256, config.seed, shuffle=False
    )

    amp, mixed_precision = precision(config.strategy, device, config.amp, info)
    parallelism = Parallelism(config.strategy, config.cpu_offload, mixed_precision)
    model = parallelize(build_model(config.model).to(device), parallelism, info, device)
    share = parameter_share(model)
    log.info(
        "%s: this rank holds %d of %d parameters (%.1f%%)",
        config.strategy,
        share.local,
        share.total,
        100 * share.fraction,
    )
    optimizer = make_optimizer(
        config.optimizer, model.parameters(), config.lr, config.momentum, config.weight_decay
    )

    checkpoints = config.run_dir / "checkpoints"
    start_epoch, history = 1, []
    if config.resume or info.restart_count > 0:
        state = restore_training(
            checkpoints, model, optimizer, device, info, sharded=parallelism.sharded
        )
        if state is not None:
            amp.scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"])
            start_epoch, history = int(state["epoch"]) + 1, list(state["history"])
            log.info(
                "resumed from %s after epoch %d (rank %d)", checkpoints, start_epoch - 1, info.rank
            )
        else:
            log.info("no checkpoint in %s; starting from epoch 1", checkpoints)

    progress = config.progress if config.progress is not None else sys.stderr.isatty()
    epochs_run = 0
    for epoch in range(start_epoch, config.epochs + 1):
        started = time.perf_counter()
        data.set_loader_epoch(loader, epoch)
        with profiling(
            config.profile and epoch == start_epoch and info.is_main, config.run_dir / "profile"
        ):
            stats = train_epoch(
                model,
                loader,
                optimizer,
                amp,
                device,
                epoch,
                info=info,
                detect_anomaly=config.detect_anomaly,
                progress=progress and info.is_main,
            )
        throughput = stats.samples / (time.perf_counter() - started)  # all ranks' samples
        val = evaluate(unwrap(model), val_loader, device)
        elapsed = time.perf_counter() - started
        history.append(
            {
                "epoch": epoch,
                "train_loss": stats.loss,
                "train_accuracy": stats.accuracy,
                "val_loss": val.loss,
                "val_accuracy": val.accuracy,
                "seconds": elapsed,
                "samples_per_second": throughput,
            }
        )
        log.info(
            "epoch %d/%d train_loss=%.4f train_acc=%.4f val_loss=%.4f val_acc=%.4f "
            "(%.1fs, %.0f samples/s)",
            epoch,
            config.epochs,
            stats.loss,
            stats.accuracy,
            val.loss,
            val.accuracy,
            elapsed,
            throughput,
        )
        epochs_run += 1
        trainer_state = {
            "epoch": epoch,
            "scaler": amp.scaler.state_dict(),
            "rng": rng_state(),
            "history": history,
            "config": {"model": config.model, "seed": config.seed, "epochs": config.epochs},
        }
        save_training(
            checkpoints, model, optimizer, trainer_state, info, sharded=parallelism.sharded
        )
        if config.fail_once_at_epoch == epoch and info.restart_count == 0:
            raise SimulatedFailure(f"simulated failure after epoch {epoch} (checkpoint saved)")
        if config.stop_after_epoch == epoch:
            log.info("stopping after epoch %d as asked; resume with --resume", epoch)
            break

    net = unsharded_copy(model, parallelism, lambda: build_model(config.model), info)
    if config.digest_dir is not None and net is not None:
        config.digest_dir.mkdir(parents=True, exist_ok=True)
        (config.digest_dir / f"rank{info.rank}.sha256").write_text(weights_digest(net) + "\n")
    result = TrainResult({}, history, epochs_run=epochs_run)
    finished = not history or int(history[-1]["epoch"]) == config.epochs
    if info.is_main and finished and net is not None:
        result.metrics, result.archives = _publish(config, net, splits, history, info)
    barrier(info)
    return result


def _publish(
    config: TrainConfig,
    net: nn.Module,
    splits: data.Splits,
    history: list[dict[str, float]],
    info: DistInfo,
) -> tuple[dict[str, Any], list[Path]]:
    """Test accuracy, the QAT epochs (with `config.qat`), exports, archives, metrics JSON and
    curve PNG (rank 0 only)."""
    test_loader = data.make_loader(data.DigitsDataset(splits.test), 256, shuffle=False)
    test = evaluate(net, test_loader, torch.device("cpu"))
    log.info("test accuracy (eager fp32): %.4f on %d images", test.accuracy, test.samples)
    qat: QatModel | None = None
    if config.qat:  # after the fp32 epochs (or from a resumed run's last checkpoint)
        progress = config.progress if config.progress is not None else sys.stderr.isatty()
        qat = finetune(
            net, splits, config.qat_settings(), first_epoch=config.epochs + 1, progress=progress
        )
        history = [*history, *qat.history]
    metrics: dict[str, Any] = {
        "model": config.model,
        "name": config.name,
        "dataset": "sklearn-digits",
        "epochs": config.epochs,
        "seed": config.seed,
        "world_size": info.world_size,
        "strategy": config.strategy,
        "cpu_offload": config.cpu_offload,
        "amp": config.amp,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "batch_size": config.batch_size,
        "train_samples": len(splits.train),
        "test_samples": test.samples,
        "test_accuracy": test.accuracy,
        "test_loss": test.loss,
        "weights_sha256": weights_digest(net),
        "history": history,
        "exports": {},
    }
    if qat is not None:
        metrics["qat"] = {
            "epochs": qat.settings.epochs,
            "lr": qat.settings.lr,
            "seconds": qat.seconds,
        }

    export_dir = config.run_dir / "export"
    export_dir.mkdir(parents=True, exist_ok=True)
    example = splits.train.images[:2]
    held_out = splits.test.images
    contents = ArchiveContents(
        class_names=data.CLASS_NAMES,
        preprocessing=data.preprocessing_config(),
        sample=splits.test.images[:1].numpy(),
        # The whole test split: the int8 accuracy guard, and anyone comparing int8 with fp32
        # later, then measure on the same images as the recorded test accuracy.
        validation_inputs=splits.test.images.numpy(),
        validation_labels=splits.test.labels.numpy(),
        version=config.version,
        model_config={"batchSize": 32, "maxBatchDelay": 2},
    )
    support = write_support_files(contents, export_dir / "support")
    archives = []
    programs: dict[str, tuple[Exported, ExportedProgram]] = {}
    for fmt in config.formats:
        exported = _export(fmt, net, export_dir, example, held_out, contents, programs, qat)
        logits = runner_for(exported.model_format)(exported.path, held_out.numpy())
        accuracy = float((logits.argmax(1) == splits.test.labels.numpy()).mean())
        archive_metrics = {
            "testAccuracy": accuracy,
            "testSamples": len(splits.test),
            "eagerTestAccuracy": test.accuracy,
            "maxAbsDiffVsEager": exported.max_abs_diff,
            "dataset": "sklearn-digits",
            "epochs": config.epochs,
            "seed": config.seed,
            **exported.metrics,
        }
        path = build_model_archive(
            exported, contents, support, config.out, config.name, archive_metrics
        )
        log.info(
            "%s: %s test accuracy %.4f (max |diff| vs eager %.2g)",
            path,
            fmt,
            accuracy,
            exported.max_abs_diff,
        )
        metrics["exports"][fmt] = {"archive": str(path), **archive_metrics}
        archives.append(path)
    write_metrics(config.run_dir / "metrics.json", metrics)
    qat_note = f", QAT after epoch {config.epochs}" if qat is not None else ""
    title = f"{config.name} ({config.model}{qat_note})"
    plot_curves(config.run_dir / "curve.png", history, title)
    return metrics, archives


def _export(
    fmt: str,
    net: nn.Module,
    folder: Path,
    example: torch.Tensor,
    held_out: torch.Tensor,
    contents: ArchiveContents,
    programs: dict[str, tuple[Exported, ExportedProgram]],
    qat: QatModel | None = None,
) -> Exported:
    """One format's export; the `.pt2` export (and its program) is kept in `programs`, as
    the int8 package is made from it (or, with `qat`, from the QAT model) and measured
    against it."""
    if fmt in ("pt2", "pt2-int8") and "pt2" not in programs:
        programs["pt2"] = export_pt2(net, folder / "model.pt2", example, held_out)
    if fmt == "pt2":
        return programs["pt2"][0]
    if fmt == "pt2-int8":
        fp32, program = programs["pt2"]
        if qat is not None:
            return export_qat_int8(
                qat,
                fp32,
                program,
                folder,
                contents.sample,
                contents.validation_inputs,
                contents.validation_labels,
            )
        return export_pt2_int8(
            program,
            fp32,
            folder,
            contents.sample,
            contents.validation_inputs,
            contents.validation_labels,
        )
    if fmt == "torchscript":
        return export_torchscript(net, folder / "model.pt", held_out)
    if fmt == "traced":
        return export_traced(net, folder / "traced.pt", example, held_out)
    if fmt == "onnx":
        return export_onnx(net, folder / "model.onnx", example, held_out)
    if fmt == "torchscript-int8":
        return export_torchscript_int8(
            net, folder, contents.sample, contents.validation_inputs, contents.validation_labels
        )
    raise ExportError(f"unknown format {fmt!r}")
