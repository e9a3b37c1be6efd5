"""Data parallel runs (``torchrun`` / ``accelerate launch``; DDP, or FSDP as ``sharding.py`` sets up): the process
group, this process's rank and the few collectives beside Trainer's own (the conversion pipeline's barriers, stage
1's loss reports). With one process every function is a no-op."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    """How many processes the launcher started (``WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Whether this process writes the files of a run (rank 0)."""
    return rank() == 0


def init_process_group() -> None:
    """Join the launcher's process group when there are several processes: gloo for CPU tensors, and with CUDA
    nccl for GPU tensors (stage 1 averages wherever the student lives; Trainer's DDP and FSDP's device meshes reuse
    the group)."""
    if world_size() > 1 and not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend=backend)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def average(tensors: list[torch.Tensor]) -> None:
    """Replace each tensor in place by its mean over the processes (one flat all-reduce)."""
    if world_size() == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= world_size()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def local_share(size: int, what: str) -> int:
    """This process's part of a batch of ``size`` (``what`` names the setting): the batch must split evenly."""
    world = world_size()
    if size % world:
        raise ValueError(f"{what} {size} does not split over {world} processes (make it a multiple of {world})")
    return size // world
