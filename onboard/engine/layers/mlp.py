"""The gated MLP, down(act(gate(x)) * up(x)): llama's MLP, and one MoE expert.

`swiglu_limit` clamps as GLM-5.3-Flash's MLPs and experts do (transformers' `Glm5NextTextMLP` and
`Glm5NextTextExperts._apply_gate`): the gate from above at the limit, the up projection to
[-limit, limit], before the product."""

from typing import Any

import torch
from transformers.activations import ACT2FN

from onboard.engine.layers.weight_source import WeightSource, fused_or_split


class LlamaMLP(torch.nn.Module):
    def __init__(
        self,
        config: Any,
        weights: WeightSource,
        prefix: str,
        swiglu_limit: float | None = None,
        expert: bool = False,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ):
        """`names`: the gate, up and down linears as stored (Mixtral's experts: `w1`, `w3`, `w2`)."""
        super().__init__()
        gate, up, down = names
        self.gate_up_proj, split = fused_or_split(weights, [f"{prefix}.{gate}", f"{prefix}.{up}"])
        self.gate_proj, self.up_proj = split if split is not None else (None, None)
        self.down_proj = weights.linear(f"{prefix}.{down}")
        self.act_fn = ACT2FN[config.hidden_act]
        self.limit = swiglu_limit
        # transformers holds an unquantized checkpoint's MoE experts as one `gate_up_proj`, so its
        # activation reads the gate half of each [.., 2I] row in place, and float32 SiLU rounds such
        # a strided half otherwise than a contiguous tensor (issue #37's MLA sweep: every case of
        # hidden size 96). A clamp (`swiglu_limit`) copies the half first; a quantized artifact's
        # reference has linearized experts, one linear each.
        unquantized = getattr(weights, "quantization_config", None) is None
        self.halves = expert and swiglu_limit is None and unquantized and self.gate_up_proj is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if self.halves:
                gate, up = torch.cat([gate, up], dim=-1).chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj.forward(self.act_fn.forward(gate) * up)
