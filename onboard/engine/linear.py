"""A linear layer as the engine runs it: dequantized weights, emulated activation quantization.

The weights module (`weights.py`) builds these from a plain or compressed-tensors checkpoint;
the model code only calls them.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

# PyTorch's CPU addmm hands a bf16 product to oneDNN only when m*n*k exceeds 16**3 (`checksize` in
# aten/src/ATen/native/mkldnn/Matmul.cpp); smaller ones run its own kernel.
_ONEDNN_MIN_SIZE = 16**3


def onednn_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout, or None where `F.linear` would not use oneDNN.

    On CPU, `F.linear` on bf16 runs a oneDNN matmul that reorders the plain `[out, in]` weight into
    oneDNN's blocked layout on every call: for a decode step that is most of the time (measured on
    2 AVX512-BF16 cores: 3072x576 GEMV 71 us plain, 36 us pre-reordered).  Reordering once, as
    PyTorch's own inductor freezing pass does, runs the same kernel on the same blocked weight, so
    results are bit-identical to `F.linear` (and to transformers, which calls it); a test pins that.
    The op is private to PyTorch; where it is missing the plain path is used.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return None
    mkldnn = torch.ops.mkldnn
    if not (hasattr(mkldnn, "_reorder_linear_weight") and mkldnn._is_mkldnn_bf16_supported()):
        return None
    out_features, in_features = weight.shape
    if out_features * in_features <= _ONEDNN_MIN_SIZE:  # then m*n*k <= 16**3 for m = 1 already
        return None
    return mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def pytorch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of bf16 rows through PyTorch's own kernels rather than oneDNN.

    With oneDNN switched off, PyTorch runs a single bf16 row through its reduced-precision GEMV
    fast path (fp32 dot products over the plain weight), which streams the weights at about 28 GB/s
    on 2 AVX512-BF16 cores where oneDNN's kernels reach about 17 (a SmolLM2-135M decode step's
    121 GEMVs: 9.5 ms against 15); several rows run the same dot product each, so a row's result
    does not depend on how many are multiplied (measured bitwise up to 64 rows), but the time grows
    with the rows.  PyTorch has no public switch for one call; the flag is restored even on error."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


class EngineLinear(torch.nn.Module):
    """y = quant(x) @ W.T + b, with W already dequantized to the compute dtype and `quant` the
    format's activation fake-quantization (None for weight-only and unquantized layers).

    On CPU in bf16 the weight is held only in oneDNN's pre-reordered layout (`onednn_packed_weight`);
    `weight` then reorders it back to a plain tensor on each access.  `use_fast_kernels` picks fast
    numerics' kernels."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fmt: str = "bf16",
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = onednn_packed_weight(weight)
        self.plain = None if self.packed is not None else torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.fmt = fmt  # "bf16" | "nvfp4" | "nvfp4a16" | "fp8" ...
        self.row_weight: torch.Tensor | None = None
        self.pytorch_kernels = False

    def use_fast_kernels(self, batch_invariant: bool) -> None:
        if self.packed is not None and not batch_invariant and self.row_weight is None:
            self.row_weight = self.packed.to_dense().contiguous()
        # A CPU weight too small for packing: `F.linear` picks oneDNN or PyTorch's kernel by the
        # product's size (`_ONEDNN_MIN_SIZE`), so a row would round by how many share the call.
        plain = self.plain
        self.pytorch_kernels = plain is not None and plain.device.type == "cpu" and plain.dtype == torch.bfloat16

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized `[out, in]` weight in the compute dtype."""
        return self.plain if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant is not None:
            x = self.act_quant(x)
        if self.packed is not None:
            if x.dim() == 2 and x.shape[0] == 1:
                if self.row_weight is not None:
                    return pytorch_linear(x, self.row_weight, self.bias)
                # oneDNN runs a single row through another kernel than several rows, which sums in
                # another order: padding to two rows keeps a request's tokens the same whatever else
                # is batched with it (batch invariance; measured by `onboard smoke`).
                return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), self.packed, self.bias, "none", [], "")[:1]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.pytorch_kernels:
            return pytorch_linear(x, self.plain, self.bias)
        return F.linear(x, self.plain, self.bias)


def use_fast_kernels(model: torch.nn.Module, batch_invariant: bool) -> None:
    """Fast numerics' linears in `model`: bf16 weights too small to pack through PyTorch's own
    kernel at every row count (batch invariant), and, without batch invariance, single rows of
    the packed ones through its one-row GEMV (`pytorch_linear`), holding those weights twice."""
    for module in model.modules():
        if isinstance(module, EngineLinear):
            module.use_fast_kernels(batch_invariant)
