"""The paged KV cache: per layer, a key and a value tensor of fixed-size token blocks.

Layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.  A token's flat slot is
`block * block_size + offset`; every layer uses the same block table for a sequence, so one
`slot_mapping` per step serves all layers.  All layers live in one allocation (`self.kv`), the
per-layer tensors are views of it.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model needs from the cache; the runner picks `num_blocks` and `block_size`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Zero-filled: slots that padded decode batches read but mask out stay finite.
        self.kv = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.k_caches: list[torch.Tensor] = list(self.kv[0].unbind(0))
        self.v_caches: list[torch.Tensor] = list(self.kv[1].unbind(0))
        # Flat [num_blocks * block_size, kvh, d] views, for writing by slot.
        self._k_flat = [k.view(-1, num_kv_heads, head_dim) for k in self.k_caches]
        self._v_flat = [v.view(-1, num_kv_heads, head_dim) for v in self.v_caches]

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str) -> "KVCache":
        return cls(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, spec.dtype, device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store `k`, `v` (`[T, kvh, d]`) at the flat slots `slot_mapping` (`[T]` int64)."""
        self._k_flat[layer].index_copy_(0, slot_mapping, k)
        self._v_flat[layer].index_copy_(0, slot_mapping, v)

    def gather(
        self, layer: int, block_table: torch.Tensor | list[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` tokens of one sequence, each `[length, kvh, d]`."""
        num_blocks = -(-length // self.block_size)
        if isinstance(block_table, list):
            block_table = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=self.device)
        else:
            block_table = block_table[:num_blocks]
        shape = (-1, self.num_kv_heads, self.head_dim)
        k = self.k_caches[layer].index_select(0, block_table).view(shape)[:length]
        v = self.v_caches[layer].index_select(0, block_table).view(shape)[:length]
        return k, v
