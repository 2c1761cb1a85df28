"""Quantization-aware training (QAT) through torchao's PT2E flow, and the int8 `.pt2` made from it.

Post-training int8 (PTQ, archiver/int8/pt2.py) rounds a finished fp32 model. QAT fine-tunes the
model with that rounding in its forward pass, so that its weights learn to work with it:

1. `prepare`: `torch.export.export(model, ...).module()` (the graph to train, batch dynamic),
   then `prepare_qat_pt2e` with torchao's `X86InductorQuantizer` set to
   `get_default_x86_inductor_quantization_config(is_qat=True)`: uint8 per-tensor activations and
   int8 per-channel weights, as static PTQ, each behind a fake-quantize module whose moving
   min/max sets its scale. Gradients pass the rounding straight through.
2. `finetune`: a few epochs of the training loop on that graph. The observers are frozen for
   the last epoch, so that the weights end tuned to the scales the int8 model will use.
3. `export_int8`: `convert_pt2e`, then what every int8 `.pt2` goes through: the compile with
   Inductor freezing under no_grad and the check that the compiled code runs fused int8
   kernels (archiver/int8/pt2.py), the accuracy guard (archiver/accuracy.py) against the
   fake-quantized model that was trained, and the report the manifest records, plus how QAT
   ran and what static PTQ of the same fp32 model reaches (`ptq_accuracy`).

A convolution whose input has one channel (LeNet's first) stays fp32, in QAT and in its PTQ
baseline alike: Inductor (torch 2.13) compiles its int8 version wrong with a dynamic batch. It
takes the output of oneDNN's int8 convolution to be contiguous where it is channels-last
(the one-channel input is both), and the next kernel reads it in the wrong order: a static
int8 LeNet compiled so agreed with its own eager reference on 47 of 200 test images, all with
that convolution left fp32. The accuracy guard refuses such a package; this keeps it right.

    qat = finetune(net, splits, QatSettings(epochs=3, lr=0.002))
    exported = export_int8(qat, fp32, program, folder, sample, test_inputs, test_labels)
    exported.quantization.details["qat"]  # epochs, learning rate, PTQ baseline, ...
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from scriptserve.archiver.accuracy import (
    QuantizationError,
    Runner,
    Tolerance,
    ValidationSamples,
    check_tolerance,
    compare,
    max_abs_diff,
)
from scriptserve.archiver.int8 import pt2 as pt2_int8
from scriptserve.archiver.int8.conversion import QuantizeOptions
from scriptserve.archiver.model_file import ModelFileError
from scriptserve.archiver.pt2_check import PackageRunner, Pt2Build, check_package
from scriptserve.archiver.pt2_export import compile_options, compile_package, export_model
from scriptserve.archiver.quantize import STATIC_INT8, QuantizationReport, sha256_of
from scriptserve.training import data
from scriptserve.training.export import (
    INPUT_NAME,
    PT2_MAX_BATCH,
    Exported,
    ExportError,
    run_pt2,
)
from scriptserve.training.loop import AmpPolicy, evaluate, make_optimizer, train_epoch

if TYPE_CHECKING:
    from torch.export import ExportedProgram

log = logging.getLogger("training")

QUANTIZER = "X86InductorQuantizer"
QUANTIZER_CONFIG = "get_default_x86_inductor_quantization_config(is_qat=True)"
LATENCY_RUNS = 20
CPU = torch.device("cpu")


@dataclass(frozen=True)
class QatSettings:
    """How to fine-tune with fake quantization (the optimizer as for the fp32 epochs)."""

    epochs: int = 3
    lr: float = 0.002
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    seed: int = 0
    reduce_range: bool | None = None
    """7-bit activations; None decides as archiver's int8 does (on where the CPU lacks VNNI)."""

    def reduces_range(self) -> bool:
        return QuantizeOptions(reduce_range=self.reduce_range).reduces_range()


@dataclass(frozen=True)
class QatModel:
    """A model fine-tuned with fake quantization, ready to convert to int8."""

    prepared: Any
    """The fake-quantized graph (torch.fx.GraphModule), in eval mode, observers frozen."""
    settings: QatSettings
    history: list[dict[str, float]]
    """One entry per QAT epoch, as the run's history has them, with `"qat": 1.0`."""
    seconds: float
    calibration_inputs: np.ndarray
    """The validation split's inputs, on which the static PTQ baseline calibrates."""
    left_float: tuple[str, ...] = ()
    """Layers left fp32 (one-channel convolutions), by module name."""


def quantizer_for(graph: Any, *, qat: bool, reduce_range: bool) -> tuple[Any, tuple[str, ...]]:
    """torchao's X86InductorQuantizer with its default config for QAT or static PTQ (the one
    archiver's static int8 uses), leaving one-channel convolutions fp32: (quantizer, their
    names)."""
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    quantizer = X86InductorQuantizer()
    quantizer.set_global(
        get_default_x86_inductor_quantization_config(is_qat=qat, reduce_range=reduce_range)
    )
    left = pt2_int8.one_channel_convolutions(graph)
    for name in left:
        quantizer.set_module_name_qconfig(name, None)
    return quantizer, left


def prepare(
    model: nn.Module, example: torch.Tensor, reduce_range: bool
) -> tuple[Any, tuple[str, ...]]:
    """A copy of `model` exported for training and prepared for QAT, and the layers left fp32;
    `model` is left as is."""
    from torch.export import Dim
    from torchao.quantization.pt2e import allow_exported_model_train_eval
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    # A copy: the exported graph shares the module's parameters, and the fp32 archives are
    # made from the fp32 weights after QAT has changed its own.
    trainable = copy.deepcopy(model).to(CPU).train()
    dynamic = ({0: Dim("batch", min=1)},)
    try:
        graph = torch.export.export(trainable, (example,), dynamic_shapes=dynamic).module()
        quantizer, left = quantizer_for(graph, qat=True, reduce_range=reduce_range)
        prepared = prepare_qat_pt2e(graph, quantizer)
    except Exception as exc:  # export and torchao raise what the model's ops raise
        raise ExportError(f"QAT: torchao's PT2E preparation failed: {exc}") from None
    # torchao refuses train()/eval() on an exported graph, as they switch only dropout and
    # batch norm there; no other op differs, so the training loop may call them.
    allow_exported_model_train_eval(prepared)
    return prepared, left


def finetune(
    model: nn.Module,
    splits: data.Splits,
    settings: QatSettings,
    *,
    first_epoch: int = 1,
    progress: bool = False,
) -> QatModel:
    """Fine-tune a copy of `model` with fake quantization for `settings.epochs` epochs on the
    training split (numbered from `first_epoch`, which also seeds their shuffles), logging one
    line per epoch with the validation accuracy of the fake-quantized model."""
    from torchao.quantization.pt2e import disable_observer, enable_observer

    prepared, left = prepare(model, splits.train.images[:2], settings.reduces_range())
    loader = data.make_loader(data.DigitsDataset(splits.train), settings.batch_size, settings.seed)
    val_loader = data.make_loader(data.DigitsDataset(splits.validation), 256, shuffle=False)
    optimizer = make_optimizer(
        settings.optimizer,
        prepared.parameters(),
        settings.lr,
        settings.momentum,
        settings.weight_decay,
    )
    amp = AmpPolicy.for_device(CPU, enabled=False)  # fake quantization runs in fp32
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    for step in range(1, settings.epochs + 1):
        epoch = first_epoch + step - 1
        epoch_started = time.perf_counter()
        data.set_loader_epoch(loader, epoch)
        last = step == settings.epochs and settings.epochs > 1
        prepared.apply(disable_observer if last else enable_observer)
        stats = train_epoch(prepared, loader, optimizer, amp, CPU, epoch, progress=progress)
        throughput = stats.samples / (time.perf_counter() - epoch_started)
        prepared.apply(disable_observer)  # validation images must not move the ranges
        val = evaluate(prepared, val_loader, CPU)
        elapsed = time.perf_counter() - epoch_started
        history.append(
            {
                "epoch": epoch,
                "train_loss": stats.loss,
                "train_accuracy": stats.accuracy,
                "val_loss": val.loss,
                "val_accuracy": val.accuracy,
                "seconds": elapsed,
                "samples_per_second": throughput,
                "qat": 1.0,
            }
        )
        log.info(
            "qat epoch %d/%d train_loss=%.4f train_acc=%.4f val_loss=%.4f val_acc=%.4f "
            "(%.1fs, %.0f samples/s)",
            step,
            settings.epochs,
            stats.loss,
            stats.accuracy,
            val.loss,
            val.accuracy,
            elapsed,
            throughput,
        )
    prepared.eval()
    return QatModel(
        prepared,
        settings,
        history,
        time.perf_counter() - started,
        splits.validation.images.numpy(),
        left,
    )


def ptq_accuracy(
    program: ExportedProgram,
    folder: Path,
    sample: np.ndarray,
    calibration: np.ndarray,
    inputs: np.ndarray,
    labels: np.ndarray,
    reduce_range: bool,
) -> float:
    """Top-1 accuracy on (`inputs`, `labels`) of static int8 made from the fp32 `program` as
    archiver's static int8 makes it (archiver/int8/pt2.py: the X86 quantizer's default static
    config, HistogramObserver activation ranges calibrated on `calibration` in batches of
    CALIBRATION_ROWS, `convert_pt2e`, then the same compile and int8 kernel check), with the
    layers QAT leaves fp32 left fp32 too. The package is measured, then removed."""
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    dst = folder / "model.ptq-baseline.pt2"
    graph = program.module()
    try:
        quantizer, _ = quantizer_for(graph, qat=False, reduce_range=reduce_range)
        prepared = prepare_pt2e(graph, quantizer)
        move_exported_model_to_eval(prepared)
        with torch.no_grad():
            for start in range(0, len(calibration), pt2_int8.CALIBRATION_ROWS):
                prepared(torch.from_numpy(calibration[start : start + pt2_int8.CALIBRATION_ROWS]))
        converted = convert_pt2e(prepared)
    except Exception as exc:  # torchao raises what the model's ops raise
        raise ExportError(f"QAT's static int8 baseline failed: {exc}") from None
    try:
        _compile(converted, dst, {INPUT_NAME: sample})
        logits = run_pt2(dst, inputs)
    finally:
        dst.unlink(missing_ok=True)
    return float((logits.argmax(1) == labels).mean())


def _eager_runner(model: Any) -> Runner:
    """The (fake-quantized) graph as the accuracy guard runs models."""

    def run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        (value,) = inputs.values()
        with torch.no_grad():
            out: torch.Tensor = model(torch.from_numpy(np.ascontiguousarray(value)))
        return {"output0": out.numpy()}

    return run


def _converted(qat: QatModel) -> Any:
    """`convert_pt2e` of a copy: the fake-quantized model stays, as the guard's reference."""
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    prepared = copy.deepcopy(qat.prepared)
    move_exported_model_to_eval(prepared)
    try:
        return convert_pt2e(prepared)
    except Exception as exc:  # torchao raises what the model's ops raise
        raise ExportError(f"QAT: torchao's convert_pt2e failed: {exc}") from None


def _latency_ms(
    fp32: Runner, int8: Runner, sample: Mapping[str, np.ndarray]
) -> tuple[float, float]:
    """Medians of alternating calls after a warm-up, as archiver/quantize.py measures them."""
    for _ in range(3):
        fp32(sample)
        int8(sample)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(LATENCY_RUNS):
        for runner, out in ((fp32, times[0]), (int8, times[1])):
            started = time.perf_counter()
            runner(sample)
            out.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def _compile(
    converted: Any, dst: Path, sample: Mapping[str, np.ndarray]
) -> tuple[dict[str, int], Pt2Build, dict[str, Any]]:
    """Export, compile and check the converted model: its int8 kernels, its build record and
    the compile options."""
    options = compile_options()
    try:
        compile_package(export_model(converted, sample, PT2_MAX_BATCH), dst, options)
        kernels = pt2_int8.check_kernels(dst)
        build = check_package(dst, sample, None, "eager", exported_bound=PT2_MAX_BATCH)
    except (ModelFileError, QuantizationError) as exc:
        dst.unlink(missing_ok=True)
        raise ExportError(f"int8 .pt2 export refused: {exc}") from None
    return kernels, build, {**options, "noGrad": True}


def export_int8(
    qat: QatModel,
    fp32: Exported,
    program: ExportedProgram,
    folder: Path,
    sample: np.ndarray,
    validation_inputs: np.ndarray,
    validation_labels: np.ndarray,
) -> Exported:
    """The int8 `.pt2` package of a QAT model, checked like every int8 package: fused int8
    kernels in the compiled code, and the accuracy guard on the validation samples against
    the fake-quantized model (ExportError when either refuses it). Its report measures it
    against the fp32 package `fp32` (compiled from `program`, the model QAT started from),
    and records how QAT ran and the static PTQ baseline's accuracy on the same samples."""
    import torchao

    reduce_range = qat.settings.reduces_range()
    ptq = ptq_accuracy(
        program,
        folder,
        sample,
        qat.calibration_inputs,
        validation_inputs,
        validation_labels,
        reduce_range,
    )
    dst = folder / "model.int8.pt2"
    named = {INPUT_NAME: sample}
    kernels, build, compiled = _compile(_converted(qat), dst, named)
    reference = _eager_runner(qat.prepared)
    int8, fp32_runner = PackageRunner(dst), PackageRunner(fp32.path)
    try:
        checked = compare(
            reference, int8, ValidationSamples({INPUT_NAME: validation_inputs}, validation_labels)
        )
        check_tolerance(checked, Tolerance())
        diff = max_abs_diff(reference(named), int8(named))
        fp32_ms, int8_ms = _latency_ms(fp32_runner, int8, named)
    except QuantizationError as exc:
        dst.unlink(missing_ok=True)
        raise ExportError(f"int8 .pt2 export (QAT) refused: {exc}") from None
    finally:
        int8.close()
        fp32_runner.close()
    options: dict[str, Any] = {
        "flow": "pt2e",
        "method": "qat",
        "quantizer": QUANTIZER,
        "quantizerConfig": QUANTIZER_CONFIG,
        "scheme": "static",
        "reduceRange": reduce_range,
        "torchao": torchao.__version__,
        "source": "qat",
        "compileOptions": compiled,
    }
    left_float = {"convolution of one input channel": len(qat.left_float)} if qat.left_float else {}
    report = QuantizationReport(
        model_format="pt2",
        source_sha256=sha256_of(fp32.path),
        fp32_bytes=fp32.path.stat().st_size,
        int8_bytes=dst.stat().st_size,
        fp32_latency_ms=round(fp32_ms, 5),
        int8_latency_ms=round(int8_ms, 5),
        max_abs_diff=diff,
        quantized_ops=kernels,
        left_float=left_float,
        engine="onednn",
        options=options,
        validation=checked,
        int8_sha256=sha256_of(dst),
        mode=STATIC_INT8,
    )
    last = qat.history[-1] if qat.history else {}
    how = {
        "epochs": qat.settings.epochs,
        "lr": qat.settings.lr,
        "optimizer": qat.settings.optimizer,
        "batchSize": qat.settings.batch_size,
        "observersFrozenLastEpoch": qat.settings.epochs > 1,
        "seconds": round(qat.seconds, 3),
        "fakeQuantValAccuracy": last.get("val_accuracy"),
        "guardReference": "the fake-quantized model QAT trained (eager)",
        "ptqAccuracy": ptq,
        "ptqCalibrationSamples": len(qat.calibration_inputs),
        "leftFloat": list(qat.left_float),
    }
    entry = report.manifest_entry("training")
    entry = replace(entry, details={**entry.details, "qat": how})
    log.info(
        "int8 .pt2 (QAT, %d epochs): %.2fx smaller, %.2fx faster than fp32 on the sample input; "
        "accuracy %.4f, static int8 (PTQ) %.4f",
        qat.settings.epochs,
        report.size_ratio,
        report.latency_ratio,
        checked.int8_accuracy or 0.0,
        ptq,
    )
    info = replace(build.info, compile_options=compiled)
    metrics = {"quantization": "qat", "qatEpochs": qat.settings.epochs, "ptqTestAccuracy": ptq}
    return Exported(
        "pt2-int8", dst, "pt2", float(checked.max_abs_diff), entry, pt2=info, metrics=metrics
    )
