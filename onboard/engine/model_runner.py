"""Turns one scheduled step into a forward pass over the paged KV cache, and logits."""

from pathlib import Path

import torch
from transformers import AutoConfig

from onboard.engine.batch import ForwardBatch
from onboard.engine.config import EngineConfig
from onboard.engine.kv_cache import KVCache
from onboard.engine.models import model_class
from onboard.engine.scheduler import ScheduledSeq
from onboard.engine.weights import CheckpointWeights


class ModelRunner:
    def __init__(self, path: Path, config: EngineConfig, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.hf_config = AutoConfig.from_pretrained(path)
        weights = CheckpointWeights(Path(path), dtype=dtype, device=device)
        self.model = model_class(self.hf_config)(self.hf_config, weights)
        text = self.hf_config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.cache = KVCache(
            num_layers=text.num_hidden_layers,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=self.device,
        )
        self.vocab_size = text.vocab_size

    def prepare(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        block_size = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables, logits_rows, decoding = [], [], [], [], []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            tables.append(table)
            decoding.append(start >= seq.num_prompt_tokens)
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return ForwardBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            logits_indices=as_tensor(logits_rows),
            block_size=block_size,
            decoding=decoding,
        )

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """float32 logits [S, vocab] for the scheduled sequences that sample this step, in order."""
        batch = self.prepare(scheduled)
        hidden = self.model.forward(batch, self.cache)
        if len(batch.logits_indices) == 0:
            return torch.empty(0, self.vocab_size)
        return self.model.compute_logits(hidden[batch.logits_indices])
