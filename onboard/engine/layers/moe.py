"""Routed experts: each (token, slot) pair through its expert, weighted, summed per token.

Only experts that received tokens run.  Two numerics, as transformers 5.17 has them:

* "grouped_mm" (its default, `get_correct_experts_implementation`): pairs sorted by expert id
  (`torch.sort`), each expert's rows through its MLP, the product with the routing weight in the
  promoted dtype (float32 for DeepSeek's float32 weights, the compute dtype for Qwen3's), and one
  `sum` over the k slots of a token, cast to the compute dtype once;
* "eager" (the eager loop, and llmcompressor's linearized experts that onboard's loader runs for
  quantized MoE artifacts): experts in ascending order, each one's rows in `torch.where` order
  over its [slot, token] mask, every product cast to the compute dtype and accumulated with
  `index_add_`.

A GEMM may round a row differently at another position, so the row order is theirs too.
"""

import contextlib

import torch

from onboard import cpu_bf16


def run_experts(
    experts: torch.nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, eager: bool
) -> torch.Tensor:
    """`x` `[T, H]`, routing `weights` and expert `indices` `[T, k]` -> `[T, H]` in `x`'s dtype."""
    t, hidden = x.shape
    k = indices.shape[1]
    flat_w = weights.reshape(-1, 1)
    flat_e = indices.reshape(-1)
    if eager:
        pair = torch.arange(t * k, device=x.device)
        order = torch.argsort(flat_e * (t * k) + (pair % k) * t + pair // k)
        out = torch.zeros_like(x)
    else:
        _, order = torch.sort(flat_e)
        out = x.new_empty(t * k, hidden, dtype=torch.promote_types(x.dtype, weights.dtype))
    counts = torch.bincount(flat_e, minlength=len(experts)).tolist()
    tokens = order // k
    start = 0
    # transformers' grouped_mm is not `F.linear`: its experts keep PyTorch's bf16 kernels (cpu_bf16.py).
    with contextlib.nullcontext() if eager else cpu_bf16.bf16_kernels():
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            rows = tokens[start : start + count]
            y = experts[e].forward(x.index_select(0, rows)) * flat_w.index_select(0, pairs)
            if eager:
                out.index_add_(0, rows, y.to(out.dtype))
            else:
                out.index_copy_(0, pairs, y)
            start += count
    if eager:
        return out
    return out.view(t, k, hidden).sum(dim=1).to(x.dtype)
