"""The paged KV cache, allocated from the layout a model declares.

A model says what it caches per token and layer (`KVLayout`: named tensors, each with its
per-token shape and the layers that hold it): K and V for MHA/GQA, one latent row (the
compressed `kv_lora_rank` vector and the RoPE key side by side) for MLA, and for DSA an extra
indexer-key tensor on the layers that run an indexer.  The runner allocates one tensor per
name, `[num_layers holding it, num_blocks, block_size, *shape]`.  A token's flat slot is
`block * block_size + offset`; every layer and every name uses the same block table for a
sequence, so one `slot_mapping` per step serves them all.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVTensorSpec:
    """One cached tensor: `shape` per token, held by `layers`."""

    name: str
    shape: tuple[int, ...]
    layers: tuple[int, ...]

    @property
    def elements_per_token(self) -> int:
        return math.prod(self.shape) * len(self.layers)


@dataclass(frozen=True)
class KVLayout:
    """Everything a model caches per token (all layers), in one dtype."""

    tensors: tuple[KVTensorSpec, ...]
    dtype: torch.dtype

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> "KVLayout":
        layers = tuple(range(num_layers))
        shape = (num_kv_heads, head_dim)
        return cls((KVTensorSpec("k", shape, layers), KVTensorSpec("v", shape, layers)), dtype)

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(t.elements_per_token for t in self.tensors) * elem

    def describe(self) -> dict[str, int]:
        """Bytes per token by cached tensor (all layers)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return {t.name: t.elements_per_token * elem for t in self.tensors}


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device | str):
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = layout.dtype
        self.device = torch.device(device)
        self._blocks: dict[str, list[torch.Tensor | None]] = {}
        self._flat: dict[str, list[torch.Tensor | None]] = {}
        self.storage: dict[str, torch.Tensor] = {}
        num_layers = 1 + max((max(t.layers) for t in layout.tensors if t.layers), default=-1)
        for spec in layout.tensors:
            # Zero-filled: slots that padded decode batches read but mask out stay finite.
            data = torch.zeros(len(spec.layers), num_blocks, block_size, *spec.shape, dtype=self.dtype, device=device)
            self.storage[spec.name] = data
            blocks: list[torch.Tensor | None] = [None] * num_layers
            flat: list[torch.Tensor | None] = [None] * num_layers
            for i, layer in enumerate(spec.layers):
                blocks[layer] = data[i]
                flat[layer] = data[i].view(num_blocks * block_size, *spec.shape)
            self._blocks[spec.name], self._flat[spec.name] = blocks, flat

    def blocks(self, name: str, layer: int) -> torch.Tensor:
        """`[num_blocks, block_size, *shape]` of tensor `name` in `layer`."""
        return self._blocks[name][layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, **values: torch.Tensor) -> None:
        """Store each `values[name]` (`[T, *shape]`) at the flat slots `slot_mapping` (`[T]` int64)."""
        for name, value in values.items():
            self._flat[name][layer].index_copy_(0, slot_mapping, value)

    def gather_slots(self, name: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The tokens at flat `slots` (`[n]` int64) as `[n, *shape]`."""
        return self._flat[name][layer].index_select(0, slots)

    def gather(
        self, name: str, layer: int, blocks: torch.Tensor | list[int], length: int | None = None
    ) -> torch.Tensor:
        """The tokens held by `blocks` (in order) as `[len(blocks) * block_size, *shape]`, cut to `length`."""
        if isinstance(blocks, list):
            blocks = torch.tensor(blocks, dtype=torch.long, device=self.device)
        source = self._blocks[name][layer]
        out = source.index_select(0, blocks).view(-1, *source.shape[2:])
        return out if length is None else out[:length]
