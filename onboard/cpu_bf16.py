"""bf16 linears through float32 GEMM on CPUs without a bf16 dot product (AVX2, AVX-512 before
Cooper Lake, or oneDNN capped below `AVX512_CORE_BF16`).

There PyTorch multiplies bf16 matrices with kernels that convert as they go: on a 2-core AVX2
EPYC (and under `ONEDNN_MAX_CPU_ISA=AVX2`) a 256-token forward of the demo model takes 7.6 s
against 1.0 s with avx512_bf16, and CI's quick demo took 4,000 s instead of 600.  A bf16 product
is exact in float32 (8 + 8 significant bits), so `F.linear` on the operands widened to float32,
its float32 sum rounded once to bf16, is a bf16 GEMM with float32 accumulation: the arithmetic
of oneDNN's own bf16 kernels, in another summation order (which kernels differ in anyway, and
which every proof here is built to survive: `make test-isa`).  The same forward then takes
2.2 s.  The weight is widened per call, not kept, so memory stays what the checkpoint needs; a
call of fewer than `MIN_ROWS` rows (a decode step) keeps the bf16 kernel, which streams the
weight once instead of widening it.  Under bf16 autocast (the speculator's training) the same
holds: autocast's operands rounded to bf16, then widened.

PyTorch has no switch for this (`torch.backends.mkldnn.matmul.fp32_precision` goes the other
way), so `install` wraps `torch.nn.functional.linear`, which every `nn.Linear`, transformers'
and compressed-tensors' modules and the engine's exact kernel call.  Every entry point installs
it (`onboard.cli.main`, the tests' conftest) before any model runs; where the CPU has the dot
product it does nothing.
"""

import contextlib
import os
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

MIN_ROWS = 32  # below, widening the weight costs more than the bf16 kernel saves (lm_head, 16 rows)
_BF16_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10")
_bf16_linear = F.linear
_bf16_matmul = torch.matmul
_unrouted = threading.local()


def bf16_dot_product() -> bool:
    """Whether this CPU, under the oneDNN ISA cap in the environment, multiplies bf16 natively."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    if not cap.startswith(_BF16_ISAS):
        return False
    return torch.ops.mkldnn._is_mkldnn_bf16_supported() and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )


def cap_below_native() -> str:
    """A oneDNN ISA cap under this CPU's own, so that other kernels run (a cap at or above what
    the CPU has is no cap): `AVX512_CORE` (no bf16 instructions) where it multiplies bf16
    natively, `AVX2` on AVX-512 without, `SSE41` on AVX2.  `make test-isa` runs under it."""
    if bf16_dot_product():
        return "AVX512_CORE"
    return "AVX2" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "SSE41"


def linear_via_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with bf16 CPU products of `MIN_ROWS` rows or more summed in float32 GEMM.  Under
    CPU bf16 autocast (the speculator's training) the operands are rounded to bf16 first, as
    autocast rounds them, so the arithmetic is autocast's."""
    if getattr(_unrouted, "on", False) or x.device.type != "cpu" or x.dim() == 0 or x.numel() < MIN_ROWS * x.shape[-1]:
        return _bf16_linear(x, weight, bias)
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16:
        if not (x.is_floating_point() and weight.is_floating_point()):
            return _bf16_linear(x, weight, bias)
        with torch.autocast("cpu", enabled=False):
            return _widened(x.bfloat16(), weight.bfloat16(), None if bias is None else bias.bfloat16())
    if x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16:
        return _widened(x, weight, bias)
    return _bf16_linear(x, weight, bias)


def _widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 operands multiplied in float32, the sums rounded once to bf16."""
    return _bf16_linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)


def matmul_via_fp32(a: torch.Tensor, b: torch.Tensor, **kwargs) -> torch.Tensor:
    """`torch.matmul`, with bf16 CPU products of `MIN_ROWS` rows or more summed in float32 GEMM."""
    if (
        kwargs
        or getattr(_unrouted, "on", False)
        or a.device.type != "cpu"
        or a.dtype is not torch.bfloat16
        or b.dtype is not torch.bfloat16
        or a.dim() < 2
        or a.shape[-2] < MIN_ROWS
    ):
        return _bf16_matmul(a, b, **kwargs)
    return _bf16_matmul(a.float(), b.float()).to(torch.bfloat16)


@contextlib.contextmanager
def matmuls_via_fp32() -> Iterator[None]:
    """`torch.matmul` routed as `F.linear` is, inside, where the CPU has no bf16 dot product: for
    transformers' eager attention (scores and the weighted sum of values are `torch.matmul`), which
    llm-compressor's calibration forces.  Only there: the engine's exact kernels compute what
    transformers computes outside it, with the same ops."""
    if bf16_dot_product():
        yield
        return
    torch.matmul = matmul_via_fp32
    try:
        yield
    finally:
        torch.matmul = _bf16_matmul


@contextlib.contextmanager
def bf16_kernels() -> Iterator[None]:
    """PyTorch's own bf16 kernels for the linears inside, in this thread: where the engine computes
    what transformers computes with an op the route does not wrap (`grouped_mm` experts)."""
    before = getattr(_unrouted, "on", False)
    _unrouted.on = True
    try:
        yield
    finally:
        _unrouted.on = before


def install() -> None:
    """Route bf16 linears through float32 GEMM where the CPU has no bf16 dot product."""
    if not bf16_dot_product():
        F.linear = linear_via_fp32
