"""Calibration split across processes: llm-compressor's distributed oneshot, under `torchrun`.

    torchrun --standalone --nproc-per-node 8 -m onboard quantize MODEL --out RUN

Every rank loads the model offloaded (the streamed path, which llm-compressor's distributed
oneshot requires), calibrates on its share of the calibration samples, and joins the collective
save; rank 0 alone writes the run directory, the others a scratch one that is removed.  The
artifact equals one process's (a test runs two CPU processes on gloo).
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from onboard.errors import OnboardError


def world_size() -> int:
    """How many processes torchrun started (1 outside torchrun)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return 1
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0")) if world_size() > 1 else 0


def init() -> None:
    """The process group: compressed-tensors' `init_dist` where there is an accelerator (NCCL on
    CUDA); it assumes one, so without one the group is gloo on the CPU, as it would pick."""
    import torch
    import torch.distributed as dist

    if world_size() == 1 or dist.is_initialized():
        return
    if torch.accelerator.current_accelerator() is not None:
        from compressed_tensors.offload import init_dist

        init_dist()
        return
    dist.init_process_group(backend="gloo", init_method="env://")
    dist.barrier()


def check(scheme: str, num_samples: int, smoothing: str = "none") -> None:
    """A one-line refusal of what the ranks cannot split."""
    ranks = world_size()
    if ranks > 1 and scheme == "auto":
        raise OnboardError("--scheme auto selects in one process; run it without torchrun (streamed over --max-memory)")
    if ranks > 1 and smoothing == "awq" and not torch.accelerator.is_available():
        # llm-compressor 0.14 all-reduces AWQ's statistics on the current accelerator
        raise OnboardError(
            "AWQ under torchrun needs an accelerator; run it in one process or pass --method rtn or gptq"
        )
    if num_samples < ranks:
        raise OnboardError(f"--num-samples {num_samples} gives some of the {ranks} ranks no calibration sample")


@contextlib.contextmanager
def run_root(out: Path) -> Iterator[Path]:
    """The run directory this rank writes: `out` on rank 0, a scratch directory elsewhere."""
    if rank() == 0:
        yield out
        return
    scratch = Path(tempfile.mkdtemp(prefix=f"onboard-rank{rank()}-"))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def barrier() -> None:
    """Every rank reaches this point before any goes on (nothing in one process)."""
    import torch.distributed as dist

    if world_size() > 1 and dist.is_initialized():
        dist.barrier()


def finish() -> None:
    import torch.distributed as dist

    if world_size() > 1 and dist.is_initialized():
        dist.destroy_process_group()


def from_source(value: Any) -> Any:
    """Rank 0's `value` on every rank (the others' is ignored)."""
    if world_size() == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share(dataset: Dataset) -> Dataset:
    """This rank's contiguous share of the calibration samples, as llm-compressor's
    `get_rank_partition` splits a dataset: the first `len % ranks` ranks take one more."""
    ranks, index = world_size(), rank()
    if ranks == 1:
        return dataset
    base, extra = divmod(len(dataset), ranks)
    start = index * base + min(index, extra)
    return dataset.select(range(start, start + base + (index < extra)))
