"""RMSNorm as transformers' llama and deepseek families compute it."""

import torch


class RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, op for op: normalize in float32, cast back, then multiply by the
    weight in the input dtype.  (On CPU `F.rms_norm` decomposes into these same ops anyway; on CUDA
    its fused kernel could round differently.)  `weight` may have more than one dim (a stacked
    per-head weight `[heads, d]`); the norm is always over the last dim."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)
