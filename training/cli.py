"""`scriptserve train` / `python -m scriptserve.training`: train on the digits, write archives.

Exit codes: 0 success, 2 usage error (argparse), 1 failure with a one-line reason.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from scriptserve.training.export import DEFAULT_FORMATS, FORMATS, ExportError
from scriptserve.training.models import MODELS
from scriptserve.training.strategy import STRATEGIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scriptserve.training",
        description="Train a digits classifier and write .pt2 (fp32, int8), TorchScript or ONNX "
        "archives.",
    )
    p.add_argument("--model", default="lenet", choices=sorted(MODELS), help="default lenet")
    p.add_argument("--name", default="digits", help="model (and archive) name; default digits")
    p.add_argument("--epochs", type=int, default=10, help="default 10")
    p.add_argument("--batch-size", type=int, default=32, help="per process; default 32")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr", type=float, help="default 0.02 (sgd) or 0.002 (adamw)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="initialization and shuffling seed")
    p.add_argument("--split-seed", type=int, default=0, help="train/validation/test split seed")
    p.add_argument(
        "--amp",
        action="store_true",
        help="bf16 autocast on CPU, fp16 on CUDA (fsdp on CUDA: a bf16 mixed-precision policy)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="ddp",
        help="under torchrun: ddp (a whole copy per rank; default) or fsdp (FSDP2, each rank "
        "holds a shard of every layer; sharded checkpoints that resume on any world size)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="fsdp: keep the shards, their gradients and the optimizer step on the CPU",
    )
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument(
        "--streaming", action="store_true", help="iterable-style dataset instead of map-style"
    )
    p.add_argument("--train-limit", type=int, help="use only the first N training images")
    p.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help=f"comma-separated, from {', '.join(FORMATS)} (default %(default)s; TorchScript "
        "is deprecated upstream and kept for existing deployments)",
    )
    p.add_argument(
        "--qat",
        action="store_true",
        help="quantization-aware training: after the fp32 epochs (or from the checkpoint, with "
        "--resume), fine-tune with fake int8 quantization and make the pt2-int8 archive from it",
    )
    p.add_argument("--qat-epochs", type=int, default=3, help="with --qat; default 3")
    p.add_argument("--qat-lr", type=float, help="with --qat; default --lr / 10")
    p.add_argument("--out", type=Path, default=Path("model_store"), help="archive directory")
    p.add_argument(
        "--work-dir", type=Path, help="checkpoints, metrics, plot (default OUT/NAME-training)"
    )
    p.add_argument("--version", default="1.0", help="model version recorded in the archives")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--detect-anomaly", action="store_true", help="torch.autograd.detect_anomaly")
    p.add_argument("--profile", action="store_true", help="profile the first epoch")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, help="progress bar (default: tty)"
    )
    p.add_argument(
        "--stop-after-epoch", type=int, help="stop after this epoch, as an interrupted run would"
    )
    p.add_argument(
        "--fail-once-at-epoch",
        type=int,
        help="raise after this epoch's checkpoint on a first attempt (tests torchrun restarts)",
    )
    p.add_argument(
        "--digest-dir",
        type=Path,
        help="every rank holding the whole model (all under ddp, rank 0 under fsdp) writes "
        "rankN.sha256 of its weights",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from scriptserve.training.distributed import dist_info

    rank = dist_info().rank
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s",
    )
    from scriptserve.training.run import TrainConfig, train

    lr = args.lr if args.lr is not None else (0.02 if args.optimizer == "sgd" else 0.002)
    config = TrainConfig(
        model=args.model,
        name=args.name,
        epochs=args.epochs,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        lr=lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        seed=args.seed,
        split_seed=args.split_seed,
        amp=args.amp,
        device=args.device,
        strategy=args.strategy,
        cpu_offload=args.cpu_offload,
        num_workers=args.num_workers,
        streaming=args.streaming,
        train_limit=args.train_limit,
        formats=tuple(f.strip() for f in args.formats.split(",") if f.strip()),
        out=args.out,
        work_dir=args.work_dir,
        resume=args.resume,
        detect_anomaly=args.detect_anomaly,
        profile=args.profile,
        progress=args.progress,
        stop_after_epoch=args.stop_after_epoch,
        fail_once_at_epoch=args.fail_once_at_epoch,
        digest_dir=args.digest_dir,
        version=args.version,
        qat=args.qat,
        qat_epochs=args.qat_epochs,
        qat_lr=args.qat_lr,
    )
    try:
        result = train(config)
    except (ValueError, ExportError, OSError) as exc:
        print(f"python -m scriptserve.training: error: {exc}", file=sys.stderr)
        return 1
    for path in result.archives:
        print(path)
    return 0
