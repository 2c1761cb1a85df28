"""Running under `torchrun`: process group, device per rank, and who writes.

`torchrun` sets RANK, LOCAL_RANK and WORLD_SIZE; without them the run is a single process.
The backend is NCCL when the rank has a GPU, gloo otherwise. Only rank 0 writes files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("training")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    restart_count: int = 0
    max_restarts: int = 0
    agent_store: bool = False  # the workers' process group uses the elastic agent's TCPStore

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info(environ: Mapping[str, str] | None = None) -> DistInfo:
    """What `torchrun` told this process, read from its environment."""
    env = os.environ if environ is None else environ
    return DistInfo(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def select_device(info: DistInfo, requested: str = "auto") -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is available")
    return torch.device("cuda", info.local_rank % torch.cuda.device_count())


def init_process_group(info: DistInfo, device: torch.device) -> None:
    """Join the group torchrun set up (env:// rendezvous); a no-op for a single process."""
    if not info.distributed or dist.is_initialized():
        return
    if info.is_main and info.max_restarts > 0 and info.agent_store:
        # torch 2.13's c10d rendezvous keeps one TCPStore across restarts, with the last
        # attempt's keys: restarted ranks can read dead peers' addresses and fail to connect
        # (pytorch/pytorch#135712; measured here with gloo, DDP and FSDP alike).
        log.warning(
            "elastic restarts may fail to reconnect the ranks: launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that every attempt gets a fresh store"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def barrier(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor of counters over the ranks (in place); returns it."""
    if info.distributed and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
