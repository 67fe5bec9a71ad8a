"""Data parallel training of a draft under `torchrun` or `accelerate launch`, one process's result.

Every process walks the same global batches in the same order as one process would and trains
on its share of each batch's sequences (`shard`).  A share's loss is its sum over trained
positions turned by `ddp_mean` into the loss whose gradient, averaged over the processes by DDP,
is one process's gradient of the mean over the whole batch.  Metrics are `global_sum`med before
they are divided.  Outside a launcher (no process group) every function is one process's identity.
"""

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from onboard.errors import OnboardError

T = TypeVar("T")

# How long the other processes wait for the main one's work (capturing the data can take hours).
MAIN_FIRST_TIMEOUT = timedelta(hours=48)


def launched() -> bool:
    """Started by a launcher with more than one process (`WORLD_SIZE` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init() -> None:
    """The process group of a launched run (NCCL with CUDA, each process on its `LOCAL_RANK`'s
    device; gloo on the CPU), where none is yet; nothing outside a launcher."""
    if not launched() or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def finish() -> None:
    """The process group torn down, where `init` made one: a gloo group still alive when the
    interpreter exits aborts it now and then ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def shard(items: Sequence[T]) -> list[T]:
    """This process's share of a global batch: items `rank::world_size`."""
    return list(items[rank() :: world_size()])


def global_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over processes (a new tensor; `tensor` itself in one process)."""
    if world_size() == 1:
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def ddp_mean(local_sum: torch.Tensor, global_count: torch.Tensor) -> torch.Tensor:
    """The loss of this process's `local_sum` (of per-position losses) such that DDP's average of
    the processes' gradients is the gradient of the mean over all `global_count` positions."""
    return local_sum * world_size() / global_count.clamp(min=1)


class Method(torch.nn.Module):
    """`module.name(...)` as a module's forward: what DDP wraps so that its reducer sees the
    forward of a model whose training pass is not `forward` (e.g. `Eagle3Draft.unroll`)."""

    def __init__(self, module: torch.nn.Module, name: str):
        super().__init__()
        self.module = module
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, self.name)(*args, **kwargs)


@contextlib.contextmanager
def main_first(what: str, timeout: timedelta = MAIN_FIRST_TIMEOUT) -> Iterator[None]:
    """The block on the main process, then on the others (which wait up to `timeout`): e.g. the
    main process captures the data and the others then read it.  A failure on the main process
    fails the others with a one-line error instead of leaving them waiting."""
    if world_size() == 1:
        yield
        return
    # A gloo group of its own: its timeout, not the training group's, bounds the wait.
    group = dist.new_group(backend="gloo", timeout=timeout)
    if not is_main():
        if not _from_main(True, group):
            raise OnboardError(f"{what}: failed on the main process (rank 0); see its output")
        yield
        return
    try:
        yield
    except BaseException:
        _from_main(False, group)
        raise
    _from_main(True, group)


def _from_main(value: Any, group: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def from_main(value: Callable[[], T]) -> T:
    """`value()` computed on the main process, on every process."""
    if world_size() == 1:
        return value()
    box = [value() if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
