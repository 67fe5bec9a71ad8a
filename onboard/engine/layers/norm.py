"""RMSNorm as transformers computes it: the llama and deepseek families, Qwen3.5's zero-centred and
gated forms, and KDA's sigmoid-gated one."""

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


class UpcastRMSNorm(RMSNorm):
    """gpt-oss's RMSNorm: the weight multiplies the float32 normalized state, and the product is
    cast back (transformers' `GptOssRMSNorm`), not the weight times the cast state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's and Qwen3-Next's RMSNorm: the weight is stored centred on zero and multiplied as
    `1 + w`, in float32 before the cast back (transformers' `Qwen3_5RMSNorm`, op for op)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__(weight, eps)
        self.scale = torch.nn.Parameter(1.0 + weight.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.scale).type_as(x)


class GatedRMSNorm(RMSNorm):
    """The norm that closes a Gated DeltaNet head: `w * norm(x)` in the input dtype, times
    `silu(gate)` in float32 (transformers' `Qwen3_5RMSNormGated`, op for op)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * torch.nn.functional.silu(gate.to(torch.float32))).to(dtype)


class SigmoidGatedRMSNorm(RMSNorm):
    """The norm that closes a KDA head (Kimi Linear, GLM-5.3-Flash): `w * norm(x) * sigmoid(gate)`
    all in float32, the weight included, cast back once (transformers' `*RMSNormGated`, op for op)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.to(torch.float32) * h
        return (h * torch.sigmoid(gate.to(torch.float32))).to(x.dtype)
