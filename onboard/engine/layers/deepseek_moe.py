"""The DeepSeek-style MoE block (deepseek_v3, deepseek_v32, glm_moe_dsa): routed experts + shared experts.

Numerics follow transformers 5.17's `DeepseekV3MoE` (`DeepseekV32MoE` and `GlmMoeDsaMoE` are the
same code) op for op, so bf16 outputs match it bit for bit on CPU:

* routing (`route`, transformers' `*TopkRouter`) is all float32: `F.linear` of the float32 input
  and router weight, sigmoid, `+ e_score_correction_bias` for the choice only, group-limited top-k
  (group score = sum of the group's top 2; keep `topk_group` groups), top-k with `sorted=False`;
  the weights are the un-biased sigmoid scores of the chosen experts, divided by their sum
  `+ 1e-20` when `norm_topk_prob`, times `routed_scaling_factor`, and stay float32.  The router
  weight is read as transformers holds it (cast to the compute dtype, then to float32 for the
  matmul); the bias as stored, in float32 (transformers keeps it float32, `_keep_in_fp32_modules_strict`).
* routed experts: the checkpoint's per-expert `experts.E.{gate,up,down}_proj` linears (transformers
  fuses them to 3-D tensors on load); only the experts that received tokens run.  transformers'
  default experts path is `grouped_mm` (`get_correct_experts_implementation`: None -> "grouped_mm"),
  which on CPU gives each expert's rows exactly what `F.linear` gives them.  It multiplies each
  (token, slot) output in the compute dtype by its float32 weight, so the product is float32, sums
  the k slots of a token with one float32 `sum(dim=1)` over `[T, k, H]` in the router's slot order,
  and casts to the compute dtype once.  With `experts_implementation="eager"` (the eager loop, and
  llmcompressor's linearized experts, which the quantized reference in `onboard.models.load_model`
  runs) each product is cast to the compute dtype and accumulated with `index_add_` expert by
  expert, in ascending expert order, in the compute dtype.
* shared experts: one MLP (intermediate `moe_intermediate_size * n_shared_experts`) on the block's
  input, added to the routed output in the compute dtype.
* `swiglu_limit` (GLM-5.3-Flash): every expert and the shared one clamp their gate and up
  projections (`mlp.py`); the routing is the same code (`Glm5NextTextTopkRouter`).

On CUDA (sm80+) transformers' `grouped_mm` is one grouped GEMM kernel, not per-expert cuBLAS GEMMs:
there expect a match up to GEMM reduction order only (not measured yet).
"""

from typing import Any

import torch
import torch.nn.functional as F

from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.moe import run_experts
from onboard.engine.layers.weight_source import WeightSource


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `DeepseekV3TopkRouter.forward` for `x` `[T, H]`: (weights float32 `[T, k]`,
    expert indices `[T, k]`), slots in `torch.topk(sorted=False)` order as transformers has them."""
    num_experts = gate_weight.shape[0]
    router_logits = F.linear(x.to(torch.float32), gate_weight.to(torch.float32))
    scores = router_logits.sigmoid()
    scores_for_choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    group_scores = scores_for_choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_indices


def router_weight(weights: WeightSource, prefix: str) -> torch.Tensor:
    """The router matrix `[E, H]` as transformers holds it: in the compute dtype (transformers casts
    it to the load dtype; no recipe quantizes it, but a quantized one is served dequantized)."""
    try:
        return weights.tensor(f"{prefix}.weight")
    except (KeyError, ValueError):  # stored quantized (fp8 `weight`, or `weight_packed`)
        return weights.linear(prefix).weight


def _correction_bias(weights: WeightSource, name: str, num_experts: int, device: torch.device) -> torch.Tensor:
    """`e_score_correction_bias` in float32 as stored (transformers keeps this buffer float32); zeros
    when the checkpoint has none (transformers initialises it to zeros)."""
    if not weights.has(name):
        return torch.zeros(num_experts, dtype=torch.float32, device=device)
    raw = getattr(weights, "raw", None)
    value = raw(name) if raw is not None else weights.tensor(name)
    return value.to(torch.float32)


class DeepseekMoE(torch.nn.Module):
    """transformers' `DeepseekV3MoE` over the checkpoint's per-expert linears at `prefix` (`model.layers.N.mlp`).

    `experts_implementation` defaults to the config's `_experts_implementation` and, like
    transformers, to "grouped_mm" when unset; "eager" reproduces the index_add loop.
    """

    def __init__(
        self,
        config: Any,
        weights: WeightSource,
        prefix: str,
        experts_implementation: str | None = None,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        self.num_experts = getattr(config, "n_routed_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        impl = experts_implementation or getattr(config, "_experts_implementation", None) or "grouped_mm"
        # batched_mm, deepgemm, sonicmoe: float32 products summed over the k slots, as grouped_mm.
        self.experts_implementation = "eager" if impl == "eager" else "grouped_mm"
        gate_weight = router_weight(weights, f"{prefix}.gate")
        if gate_weight.shape[0] != self.num_experts:
            raise ValueError(f"{prefix}.gate: {gate_weight.shape[0]} experts, config says {self.num_experts}")
        self.gate_weight = torch.nn.Parameter(gate_weight.to(torch.float32), requires_grad=False)
        self.e_score_correction_bias = torch.nn.Parameter(
            _correction_bias(weights, f"{prefix}.gate.e_score_correction_bias", self.num_experts, gate_weight.device),
            requires_grad=False,
        )
        self.experts = torch.nn.ModuleList(
            LlamaMLP(config, weights, f"{prefix}.experts.{e}", swiglu_limit, expert=True)
            for e in range(self.num_experts)
        )
        self.shared_experts = LlamaMLP(config, weights, f"{prefix}.shared_experts", swiglu_limit)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights float32 `[T, k]`, expert indices `[T, k]`) for `x` `[T, H]`."""
        return route(
            x,
            self.gate_weight,
            self.e_score_correction_bias,
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_indices = self.route(x)
        routed = run_experts(self.experts, x, topk_weights, topk_indices, self.experts_implementation == "eager")
        return routed + self.shared_experts.forward(x)
