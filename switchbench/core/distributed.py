"""Several processes under ``torchrun``: the world a command runs in, its process group, the share of a batch each
rank computes, and what the ranks agree on (a failure anywhere, each rank's times for the slowest's).

Without torchrun (no ``WORLD_SIZE`` in the environment, or 1) every function is the single-process identity, so a
command written with them runs unchanged on one device.
"""

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None  # nccl on CUDA, gloo on the CPU; None: one process

    @property
    def main(self) -> bool:
        """The process that prints and writes results."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


ONE = World()  # one process, no process group


def from_environment() -> World:
    """The world torchrun describes in the environment (one process without it)."""
    size, rank, local_rank = (
        _int_variable(n, d) for n, d in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"))
    )
    if size < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1; got {size}")
    # a stale RANK (a shell's, a container's) past the world measured and then wrote nothing, exit 0
    if not 0 <= rank < size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE {size}); got {rank}")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0; got {local_rank}")
    return World(size, rank, local_rank)


def _int_variable(name: str, default: str) -> int:
    value = os.environ.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer (torchrun sets it); got {value!r}") from None


@contextlib.contextmanager
def process_group(device: str) -> Iterator[World]:
    """The world, its process group started for the block (NCCL on CUDA, each rank on its local GPU; gloo on the
    CPU) and destroyed after; one process starts nothing."""
    world = from_environment()
    if not world.distributed:
        yield world
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(backend)
    try:
        yield World(world.size, world.rank, world.local_rank, backend)
        # A rank that tears its group down while a peer is still communicating (rank 0 writing, or still reading
        # the last gather) can abort inside gloo's threads ("terminate called without an active exception", seen
        # once in CI): on success the ranks meet first, with every model of the block collected while the group
        # they hold is alive. After a failure they do not meet, since a peer may never arrive (a hang, not an end).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def share(batch: int, world: World) -> slice:
    """The rows of a global batch this rank computes: equal shares, in rank order (a ValueError unless
    ``batch`` divides evenly)."""
    if batch < world.size or batch % world.size:
        raise ValueError(f"batch must be a positive multiple of the {world.size} processes; got {batch}")
    size = batch // world.size
    return slice(world.rank * size, (world.rank + 1) * size)


def wrap(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """``model`` under DistributedDataParallel when there are several processes (its gradients averaged over the
    ranks in backward, so equal shares of a batch give the whole batch's mean-loss gradient); else itself."""
    return torch.nn.parallel.DistributedDataParallel(model) if world.distributed else model


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def gathered(value, world: World) -> list:
    """Every rank's ``value``, in rank order ([value] in one process)."""
    if not world.distributed:
        return [value]
    out = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def anywhere(flag: bool, world: World) -> bool:
    """Whether ``flag`` holds on any rank."""
    return any(gathered(flag, world))


def mean(value: torch.Tensor, world: World) -> torch.Tensor:
    """The mean of ``value`` over the ranks (itself in one process): a figure of the whole batch from equal shares."""
    if not world.distributed:
        return value
    value = value.clone()
    dist.all_reduce(value)
    return value / world.size
