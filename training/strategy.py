"""How the model is spread over the ranks: DDP (a whole copy on every rank) or FSDP2.

`ddp` (the default) wraps the model in `DistributedDataParallel`: every rank holds every
parameter, gradient and optimizer state, and gradients are all-reduced. `fsdp` shards them with
`torch.distributed.fsdp.fully_shard`, layer by layer: each child layer of the model becomes its
own unit (its parameters all-gathered just before it runs and freed after), then the root, so
each of R ranks keeps about 1/R of everything between steps. `cpu_offload` keeps the shards,
their gradients and the optimizer step on the CPU (`CPUOffloadPolicy`), copied to the device
only for the all-gather. With one process there is nothing to shard: the model stays whole under
either strategy (FSDP runs still write sharded checkpoints, which any world size reads).

On CUDA, FSDP with `amp` computes in bf16 (fp16, with loss scaling, on GPUs without bf16)
through its `MixedPrecisionPolicy` (parameters cast once per all-gather, gradients reduced in
fp32) instead of autocast; everywhere else `loop.AmpPolicy` applies as for DDP.

>>> model = parallelize(build_model("lenet"), Parallelism("fsdp"), info, device)
>>> parameter_share(model)  # on each of 2 ranks
ParameterShare(local=30853, total=61706)
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scriptserve.training.distributed import DistInfo
from scriptserve.training.loop import AmpPolicy

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

log = logging.getLogger("training")
# torch.distributed.fsdp (and .tensor, .checkpoint) take about a second of CPU to import: they
# are imported where FSDP is used, so that DDP and single-process runs start as fast as before.

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class Parallelism:
    """The `--strategy` and what goes with it."""

    strategy: str = "ddp"
    cpu_offload: bool = False
    mixed_precision: MixedPrecisionPolicy | None = None

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"


@dataclass(frozen=True)
class ParameterShare:
    """Parameters held by this rank (its shards) against the whole model's."""

    local: int
    total: int

    @property
    def fraction(self) -> float:
        return self.local / self.total if self.total else 0.0


def precision(
    strategy: str, device: torch.device, amp: bool, info: DistInfo
) -> tuple[AmpPolicy, MixedPrecisionPolicy | None]:
    """What the loop autocasts to, and the policy FSDP casts with (None: FSDP casts nothing)."""
    if not (amp and strategy == "fsdp" and device.type == "cuda" and info.distributed):
        return AmpPolicy.for_device(device, amp), None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # bf16 has fp32's range and needs no loss scaling; fp16 does (GradScaler works on the
    # sharded gradients: its inf check is a DTensor op, reduced over the ranks).
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return AmpPolicy(False, device.type, dtype, scaler), policy


def parallelize(
    model: nn.Module, parallelism: Parallelism, info: DistInfo, device: torch.device
) -> nn.Module:
    """The model as the strategy trains it; unchanged in a single process."""
    if not info.distributed:
        if parallelism.sharded:
            log.info("fsdp with one process: nothing to shard, the model stays whole")
        return model
    cuda = device.type == "cuda"
    if not parallelism.sharded:
        return DistributedDataParallel(model, device_ids=[device] if cuda else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(device.type, (info.world_size,))  # over the default group
    offload = CPUOffloadPolicy(pin_memory=cuda) if parallelism.cpu_offload else OffloadPolicy()
    layer_policy = parallelism.mixed_precision or MixedPrecisionPolicy()
    layers = [
        name for name, child in model.named_children() if next(child.parameters(), None) is not None
    ]
    for name in layers:
        fully_shard(
            model.get_submodule(name), mesh=mesh, mp_policy=layer_policy, offload_policy=offload
        )
    # The root's outputs come back in fp32, so the loss is computed as without the policy.
    root_policy = MixedPrecisionPolicy(
        param_dtype=layer_policy.param_dtype,
        reduce_dtype=layer_policy.reduce_dtype,
        output_dtype=torch.float32 if parallelism.mixed_precision else None,
    )
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=offload)
    log.info(
        "fsdp over %d ranks (%s): one unit per layer (%s) and the root; mixed precision %s; "
        "cpu offload %s",
        info.world_size,
        dist.get_backend(),
        ", ".join(layers),
        layer_policy.param_dtype or "off",
        "on" if parallelism.cpu_offload else "off",
    )
    return model


def parameter_share(model: nn.Module) -> ParameterShare:
    """What this rank holds: the local shard of each sharded parameter, all of any other."""
    # FSDP's parameters are DTensors; where their module was never imported, there are none.
    tensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor: type[DTensor] | None = tensor_module.DTensor if tensor_module is not None else None
    local = total = 0
    for param in model.parameters():
        total += param.numel()  # a DTensor's numel is the whole parameter's
        if dtensor is not None and isinstance(param, dtensor):
            local += param.to_local().numel()
        else:
            local += param.numel()
    return ParameterShare(local, total)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP; an FSDP model is the user's module itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def unsharded_copy(
    model: nn.Module,
    parallelism: Parallelism,
    make_model: Callable[[], nn.Module],
    info: DistInfo,
) -> nn.Module | None:
    """The trained model as one plain module on the CPU, in eval mode, for export.

    An FSDP model's full state dict is gathered to the main rank's CPU (a collective: every
    rank calls this) and loaded into a fresh `make_model()`, so the exported module is the same
    class, with the same keys, whichever strategy trained it. Other ranks get None.
    """
    if not (parallelism.sharded and info.distributed):
        return unwrap(model).to("cpu").eval()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if not info.is_main:
        return None
    net = make_model()
    net.load_state_dict(full)
    return net.eval()
