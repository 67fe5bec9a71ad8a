"""The attention backend interface: the engine picks one per engine, every layer calls it.

A backend builds the step's metadata once (`build_metadata`), writes a layer's new cache rows
(`write`), reads a prefill sequence's cached context back (`context`), and attends: decode rows
against the paged cache (`decode`), one prefill sequence against its context (`prefill`), and
the two together for plain MHA/GQA layers (`attend`).  Attention types with other math (MLA's
latent attention, DSA's top-k restriction) are built from the same calls: `decode` takes the
names of the cached tensors to use as keys and values, a value width (MLA's values are the first
`kv_lora_rank` columns of its latent rows), and optional per-row key positions (DSA's selection).
Model code never branches on the device; the backend is where kernels differ.
"""

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from onboard.engine.attention.metadata import AttentionMetadata, PrefillSeq
from onboard.engine.batch import ForwardBatch
from onboard.engine.kv_cache import KVCache


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float, is_causal: bool) -> torch.Tensor:
    """SDPA over `[B, h, q, d]` queries and `[B, kvh, L, d]` keys; GQA without repeating K/V."""
    if q.shape[1] != k.shape[1]:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=True
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal)


class AttentionBackend(ABC):
    name: ClassVar[str]
    # A decoding sequence's draft proposals attend row by row, each as a decode step at its
    # position would: verification then gives bit for bit plain decoding's tokens.
    rowwise_verification: ClassVar[bool] = False

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def build_metadata(self, batch: ForwardBatch) -> AttentionMetadata:
        return AttentionMetadata.build(batch, self.device, self.rowwise_verification)

    def write(self, cache: KVCache, layer: int, meta: AttentionMetadata, **values: torch.Tensor) -> None:
        cache.write(layer, meta.slot_mapping, **values)

    def context(self, cache: KVCache, name: str, layer: int, seq: PrefillSeq) -> torch.Tensor:
        """The cached `[context_len, *shape]` rows of `name` for a prefill sequence continuing a prefix."""
        return cache.gather(name, layer, seq.block_table, seq.context_len)

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        layer: int,
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        keys: str = "k",
        values: str | None = "v",
        value_dim: int | None = None,
        window: int | None = None,
        selected: list[torch.Tensor] | None = None,
        fold_heads: bool = False,
    ) -> torch.Tensor:
        """Decode rows `q` `[B, h, d]` against each row's cached context -> `[B, h, dv]`.

        `values=None`: the values are the first `value_dim` columns of the keys.  `selected`: per
        row, the context positions it may attend to (all of them when None).  `fold_heads` (one
        cached head, fast numerics): the query heads run as query rows of one head, the same
        function as grouped attention but one GEMM instead of a loop over heads."""

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """One sequence: `q` `[q_len, h, d]` against `k`/`v` `[context_len, kvh, d]` -> `[q_len, h, dv]`;
        `mask` `[q_len, context_len]` bool, None for plain causal over the new tokens (a single
        query then attends to every key: SDPA's `is_causal` aligns to the top left)."""
        out = sdpa(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            mask,
            scale,
            mask is None and q.shape[0] > 1,
        )
        return out[0].transpose(0, 1)

    def attend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        layer: int,
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """MHA/GQA: write `k_new`/`v_new` (`[T, kvh, d]`), attend `q` (`[T, h, d]`) causally over each
        sequence's whole context; `[T, h, d]`."""
        self.write(cache, layer, meta, k=k_new, v=v_new)
        decode_out = None
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            q_dec = q[rows] if isinstance(rows, slice) else q.index_select(0, rows)
            decode_out = self.decode(q_dec, layer, cache, meta, scale, window=window)
            if not meta.prefill:
                return decode_out
        outputs = []
        for i, seq in enumerate(meta.prefill):
            if seq.block_table is None:
                k_i, v_i = k_new[seq.start : seq.end], v_new[seq.start : seq.end]
            else:
                k_i, v_i = self.context(cache, "k", layer, seq), self.context(cache, "v", layer, seq)
            outputs.append(
                (seq, self.prefill(q[seq.start : seq.end], k_i, v_i, meta.prefill_mask_for(i, window), scale))
            )
        return merge_rows(q.new_empty(meta.num_tokens, *q.shape[1:]), meta, outputs, decode_out)


def merge_rows(result: torch.Tensor, meta: AttentionMetadata, outputs: list, decode_out: torch.Tensor | None):
    """The step's per-token outputs from the prefill sequences' and the decode rows' results."""
    if decode_out is None and len(outputs) == 1 and outputs[0][0].query_len == meta.num_tokens:
        return outputs[0][1]
    for seq, out in outputs:
        result[seq.start : seq.end] = out
    if decode_out is not None:
        if isinstance(meta.decode_rows, slice):
            result[meta.decode_rows] = decode_out
        else:
            result.index_copy_(0, meta.decode_rows, decode_out)
    return result
