"""Rotary position embeddings, numerically as transformers' llama family computes them.

`inv_freq` and `attention_scaling` come from transformers' own `ROPE_INIT_FUNCTIONS` (linear,
dynamic, yarn, llama3, longrope, ...) or, for `rope_type == "default"`, from the same formula as
`LlamaRotaryEmbedding.compute_default_rope_parameters`.  cos/sin are computed in float32 for every
position once (`cos(pos * inv_freq) * attention_scaling`), cast to the compute dtype like
transformers does, and looked up per step by position.

Two rope types depend on the current sequence length in transformers; a paged engine serving many
sequences at once needs a per-position rule instead:

* `dynamic` (dynamic NTK) is treated as its value at `max_position_embeddings`, which is what
  transformers uses at init and for every sequence no longer than `max_position_embeddings`
  (there it equals the unscaled frequencies).  Positions beyond that keep these frequencies;
  transformers would re-scale them by the current sequence length.
* `longrope` uses the short factors for positions below `original_max_position_embeddings` and the
  long factors from there on.  transformers switches the whole sequence to the long factors once it
  grows past that length, so sequences longer than it differ (shorter ones match).

The rotation itself is transformers' `x * cos + rotate_half(x) * sin`, with `rotate_half(x) * sin`
computed as `roll(x, d/2) * sin_signed` where `sin_signed = cat(-sin1, sin2)`: negation is exact,
so the products and the sum round exactly as transformers' do, in the compute dtype.
"""

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_parameters(config: Any) -> dict:
    """The config's rope parameters, transformers-5 style (`rope_type`, `rope_theta`, ...)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # older config objects
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim_of(config: Any) -> int:
    """The dims of a head that RoPE rotates: all of them, or the first `partial_rotary_factor` of
    them (GLM-4-MoE, Qwen3.5, MiniMax-M2...), as transformers' rope init functions count them."""
    factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return int(head_dim_of(config) * (1.0 if factor is None else factor))


def compute_inv_freq(config: Any, device: torch.device | str | None = None, **kwargs) -> tuple[torch.Tensor, float]:
    """`(inv_freq [r/2] float32, attention_scaling)` for the config's rope type (r: `rotary_dim_of`)."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        dim = rotary_dim_of(config)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq.to(device), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device, **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables over positions; `forward(positions)` gives `(cos, sin_signed)`, each `[T, 1, r]`
    (r: the rotary dim, the head dim unless the rotary is partial)."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        params = rope_parameters(config)
        self.rope_type = params["rope_type"]
        self.inv_freq, self.attention_scaling = compute_inv_freq(config, self.device)
        self.rotary_dim = self.inv_freq.numel() * 2  # the tables' width
        self.long_inv_freq = None
        self.long_start = None
        if self.rope_type == "longrope":
            self.long_start = int(params["original_max_position_embeddings"])
            self.long_inv_freq, _ = compute_inv_freq(config, self.device, seq_len=self.long_start + 1)
        self.cos_sin = torch.empty(0, 2, self.rotary_dim, dtype=dtype, device=self.device)
        self._build(max(int(config.max_position_embeddings), 1))

    @property
    def max_positions(self) -> int:
        return self.cos_sin.shape[0]

    def _table(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(positions, inv_freq)  # = transformers' [d/2, 1] @ [1, T] in float32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        half = self.rotary_dim // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return torch.stack((cos, sin), dim=1).to(self.dtype)  # [N, 2, d]

    def _build(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self.device)
        table = self._table(positions, self.inv_freq)
        if self.long_inv_freq is not None and num_positions > self.long_start:
            table[self.long_start :] = self._table(positions[self.long_start :], self.long_inv_freq)
        self.cos_sin = table

    def ensure(self, num_positions: int) -> None:
        """Grow the tables to cover positions `< num_positions` (doubling)."""
        if num_positions > self.max_positions:
            size = self.max_positions
            while size < num_positions:
                size *= 2
            self._build(size)

    def forward(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions` (`[T]`), each `[T, 1, rotary dim]` in the compute dtype.

        `max_position` (an upper bound on `positions`, known on the host) lets the tables grow
        without reading the positions back from the device.
        """
        if max_position is not None:
            self.ensure(max_position + 1)
        cs = self.cos_sin.index_select(0, positions)
        return cs[:, 0:1], cs[:, 1:2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` for `x` `[T, heads, d]`, `cos`/`sin` `[T, 1, r]`:
    the first r dims rotated, the rest passed through (partial rotary, as transformers' own
    `apply_rotary_pos_emb` splits and concatenates them)."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin_signed), x[..., rotary:]], dim=-1)
    rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)
    out = x * cos
    out += rotated * sin_signed
    return out


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE as transformers' `apply_rotary_pos_emb_interleave` computes it:
    pairs `(x0, x1), (x2, x3), ...` rotated by one frequency each, written out de-interleaved
    (`[x_even', x_odd']`), from the same `cat(freqs, freqs)` tables (first half) as `apply_rotary`."""
    half = cos.shape[-1] // 2
    cos_h = cos[..., :half]
    sin_h = -sin_signed[..., :half]  # the table holds -sin in its first half: negation is exact
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos_h - x2 * sin_h, x2 * cos_h + x1 * sin_h], dim=-1)
