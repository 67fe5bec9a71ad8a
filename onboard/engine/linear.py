"""A linear layer as the engine runs it: dequantized weights, emulated activation quantization.

The weights module (`weights.py`) builds these from a plain or compressed-tensors checkpoint;
the model code only calls them.

Exact numerics call `F.linear` on the plain `[out, in]` weight with a contiguous input of the
step's rows: the op, dtypes, layout and row count transformers calls for the same request, so
whatever kernel PyTorch picks for it on this machine (oneDNN's AMX, AVX-512 or AVX2 kernels, its
own, cuBLAS) it picks for both sides.  Fast numerics run each weight through the kernels
`kernels.py` measured fastest for its shape on this machine.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from onboard.engine.kernels import BoundKernels, KernelChoice


class EngineLinear(torch.nn.Module):
    """y = quant(x) @ W.T + b, with W already dequantized to the compute dtype and `quant` the
    format's activation fake-quantization (None for weight-only and unquantized layers)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fmt: str = "bf16",
        name: str = "",
    ):
        super().__init__()
        self.name = name  # the checkpoint module it was read from ("a+b" when fused)
        self.out_features, self.in_features = weight.shape
        self.plain: torch.nn.Parameter | None = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.fmt = fmt  # "bf16" | "nvfp4" | "nvfp4a16" | "fp8" ...
        self.kernels: BoundKernels | None = None  # fast numerics' choice; None: exact

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized `[out, in]` weight in the compute dtype."""
        return self.plain if self.plain is not None else self.kernels.dense_weight()

    def use_kernels(self, choice: KernelChoice) -> None:
        """Run through `choice` (fast numerics); the plain weight is dropped where the kernels hold
        their own copy (oneDNN's blocked layout)."""
        self.kernels = BoundKernels(self.weight, choice)
        if not self.kernels.reads_plain:
            self.plain = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant is not None:
            x = self.act_quant(x)
        if self.kernels is None:
            return F.linear(x.contiguous(), self.plain, self.bias)
        if x.dim() != 2:
            return self.kernels(x.reshape(-1, x.shape[-1]), self.bias).view(*x.shape[:-1], self.out_features)
        return self.kernels(x, self.bias)
