"""torchrun: the process group of a job that runs on many devices (``encode``, and ``train`` of a shardable method).

``init_dist`` joins the job torchrun set up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL on
CUDA devices, gloo on CPUs; called inside a job that already initialised the group, it uses that one. Outside
torchrun it returns a one-process ``Dist`` and the resolved device.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from fedfeat.encoders import openclip as clipcompat
from fedfeat.errors import FedfeatError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # we initialised the process group (and destroy it)

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def broadcast(self, obj):
        """``obj`` of rank 0 on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def init_dist(distributed: bool | None, device: str) -> tuple[Dist, torch.device]:
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    want = env_world > 1 if distributed is None else (distributed or env_world > 1)
    if not want:
        return Dist(), clipcompat.resolve_device(device)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # called as a library inside a running job
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return Dist(dist.get_rank(), dist.get_world_size(), local), clipcompat.resolve_device(device, local)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise FedfeatError(
            f"--distributed needs the torchrun environment ({', '.join(missing)} unset); launch with "
            "`torchrun --nproc-per-node N -m fedfeat encode ...`"
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = clipcompat.resolve_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    # Ranks wait for each other at the end (unequal shares, text on one rank): allow long waits; torchrun
    # tears the whole job down if one rank fails, so nobody waits for a dead peer.
    kw = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=12), **kw)
    return Dist(dist.get_rank(), dist.get_world_size(), local, owns_group=True), dev
