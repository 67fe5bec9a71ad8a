"""The draft's decoder layer started from the target's last decoder layer instead of random weights.

Copied (as float32, the dequantized weights the engine serves, NVFP4 included): the MLP
(gate/up/down), `o_proj`, `post_attention_layernorm`, `hidden_norm` <- the target layer's
`input_layernorm`, and the q/k/v columns that read the fused-state half of the draft's 2H-wide
attention input (`Eagle3FirstLayer`: [input_layernorm(embeds) | hidden_norm(hidden)], so columns
H:2H).  The embedding half of q/k/v keeps its seeded random init: the fused state the copied half
reads is `fc`'s own random projection at the start, so silencing the embedding half would not make
the layer the target's either; left as nn.Linear initialises it, the ablation measures the copy
alone.  Families whose last layer is not multi-head attention with a gated MLP (MoE, MLA) keep the
random init; `init_from_last_layer` says why.  The weights come from the engine's last layer, or
(a target larger than memory) from transformers' last layer built from the checkpoint alone
(`checkpoint_layer_weights`, compressed-tensors layers decompressed): the same float32 values.
"""

import torch

from onboard.speculator.draft import Eagle3Draft

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def last_layer_weights(engine) -> dict[str, torch.Tensor] | str:
    """float32 copies of the target's last decoder layer by draft name, or why there are none."""
    from onboard.engine import LlamaAttention, LlamaMLP

    layer = engine.decoder_layer(-1)
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not isinstance(attn, LlamaAttention):
        return f"its last layer's attention is {type(attn).__name__}, not multi-head attention"
    if not isinstance(mlp, LlamaMLP):
        return f"its last layer's MLP is {type(mlp).__name__}, not a gated MLP"
    q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    if attn.qkv_proj is not None:
        q, k, v = attn.qkv_proj.weight.float().split([q_rows, kv_rows, kv_rows])
    else:
        q, k, v = (proj.weight.float() for proj in attn.qkv_split)
    if mlp.gate_up_proj is not None:
        gate, up = mlp.gate_up_proj.weight.float().chunk(2, dim=0)
    else:
        gate, up = mlp.gate_proj.weight.float(), mlp.up_proj.weight.float()
    return {
        "q_proj": q,
        "k_proj": k,
        "v_proj": v,
        "o_proj": attn.o_proj.weight.float(),
        "gate_proj": gate,
        "up_proj": up,
        "down_proj": mlp.down_proj.weight.float(),
        "hidden_norm": layer.input_layernorm.weight.float(),
        "post_attention_layernorm": layer.post_attention_layernorm.weight.float(),
    }


def _notes(engine) -> list[str]:
    """What the draft's layer cannot hold of the target's (copied anyway: it is an init)."""
    from onboard.engine import EngineLinear

    layer = engine.decoder_layer(-1)
    notes = []
    if getattr(layer.self_attn, "qk_norm", None) is not None:
        notes.append("its per-head q/k norms")
    if any(isinstance(m, EngineLinear) and m.bias is not None for m in layer.modules()):
        notes.append("its biases")
    return notes


def init_from_last_layer(draft: Eagle3Draft, engine) -> str | None:
    """Copy the target's last decoder layer into the draft's (module docstring); None when done,
    else the reason it kept the random init (nothing changed then)."""
    return init_from_weights(draft, last_layer_weights(engine))


def checkpoint_layer_weights(layer: torch.nn.Module) -> dict[str, torch.Tensor] | str:
    """`last_layer_weights` of transformers' decoder layer (`CheckpointLayers.layer`), or why none."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not all(isinstance(getattr(attn, name, None), torch.nn.Linear) for name in _ATTENTION):
        return f"its last layer's attention is {type(attn).__name__}, not multi-head attention"
    if not all(isinstance(getattr(mlp, name, None), torch.nn.Linear) for name in _MLP):
        return f"its last layer's MLP is {type(mlp).__name__}, not a gated MLP"
    weights = {name: getattr(attn, name).weight.detach().float() for name in _ATTENTION}
    weights |= {name: getattr(mlp, name).weight.detach().float() for name in _MLP}
    weights["hidden_norm"] = layer.input_layernorm.weight.detach().float()
    weights["post_attention_layernorm"] = layer.post_attention_layernorm.weight.detach().float()
    return weights


def checkpoint_layer_notes(layer: torch.nn.Module) -> list[str]:
    """`_notes` of transformers' decoder layer."""
    notes = []
    if getattr(layer.self_attn, "q_norm", None) is not None:
        notes.append("its per-head q/k norms")
    if any(isinstance(m, torch.nn.Linear) and m.bias is not None for m in layer.modules()):
        notes.append("its biases")
    return notes


def init_from_weights(draft: Eagle3Draft, weights: dict[str, torch.Tensor] | str) -> str | None:
    """Copy `last_layer_weights` (by draft name) into the draft's layer; None when done, else the
    reason it kept the random init (`weights` itself, or shapes that differ)."""
    if isinstance(weights, str):
        return weights
    ours = draft.layers[0]
    hidden = draft.layer_config.hidden_size
    targets = {
        "q_proj": ours.self_attn.q_proj.weight[:, hidden:],
        "k_proj": ours.self_attn.k_proj.weight[:, hidden:],
        "v_proj": ours.self_attn.v_proj.weight[:, hidden:],
        "o_proj": ours.self_attn.o_proj.weight,
        "gate_proj": ours.mlp.gate_proj.weight,
        "up_proj": ours.mlp.up_proj.weight,
        "down_proj": ours.mlp.down_proj.weight,
        "hidden_norm": ours.hidden_norm.weight,
        "post_attention_layernorm": ours.post_attention_layernorm.weight,
    }
    wrong = [name for name, dst in targets.items() if dst.shape != weights[name].shape]
    if wrong:
        return f"its last layer's {', '.join(wrong)} shapes differ from the draft's"
    with torch.no_grad():
        for name, dst in targets.items():
            dst.copy_(weights[name])
    return None


def describe_init(engine, reason: str | None) -> str:
    """One console line about how the draft's layer started."""
    return describe(reason, _notes(engine) if reason is None else [])


def describe(reason: str | None, notes: list[str]) -> str:
    """One console line about how the draft's layer started; `notes`: what it has no place for."""
    if reason is not None:
        return f"speculator: random init of the draft layer ({reason})"
    unheld = f"; the draft layer has no place for {' and '.join(notes)}" if notes else ""
    return f"speculator: draft layer initialised from the target's last decoder layer{unheld}"
