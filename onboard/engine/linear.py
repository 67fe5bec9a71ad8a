"""A linear layer as the engine runs it: dequantized weights, emulated activation quantization.

The weights module (`weights.py`) builds these from a plain or compressed-tensors checkpoint;
the model code only calls them.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F


class EngineLinear(torch.nn.Module):
    """y = quant(x) @ W.T + b, with W already dequantized to the compute dtype and `quant` the
    format's activation fake-quantization (None for weight-only and unquantized layers)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fmt: str = "bf16",
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.fmt = fmt  # "bf16" | "nvfp4" | "nvfp4a16" | "fp8" ...

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant is not None:
            x = self.act_quant(x)
        return F.linear(x, self.weight, self.bias)
