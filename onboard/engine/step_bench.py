"""A model's forward steps run by hand, for benchmarks of one step (`onboard bench-kv`).

A sequence is placed in the paged cache at chosen blocks with its first tokens' KV taken as
computed (whatever the cache holds there), so a decode step runs at any context without a
prefill at that length.  The model is built as `EngineConfig.numerics` builds it (its linears'
fusing and kernels, its attention backend); each step then runs as either numerics' step over it
(exact: a forward per sequence; fast: the step's rows together, MLA's fast decode forms).
"""

from pathlib import Path

import torch

from onboard.engine.attention import AttentionBackend
from onboard.engine.config import EngineConfig
from onboard.engine.model_runner import ModelRunner
from onboard.engine.scheduler import ScheduledSeq
from onboard.engine.sequence import Sequence


class StepBench:
    def __init__(self, path: Path, config: EngineConfig, dtype: torch.dtype = torch.bfloat16):
        self._runner = ModelRunner(Path(path), config, dtype=dtype)
        self.config = config
        self.device = self._runner.device

    @property
    def attention_backend(self) -> AttentionBackend:
        """The backend every step's attention runs through (`attention/base.py`)."""
        return self._runner.backend

    @property
    def num_decoder_layers(self) -> int:
        return len(self._runner.model.layers)

    def decoder_layer(self, index: int) -> torch.nn.Module:
        """Decoder layer `index` (negative: from the end), as `LLMEngine.decoder_layer`."""
        return self._runner.model.layers[index]

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the paged cache, each `[num_blocks, block_size, *per-token shape]`."""
        return [layer for data in self._runner.cache.storage.values() for layer in data]

    def place(self, token_ids: list[int], first_block: int, num_computed: int) -> ScheduledSeq:
        """`token_ids` at blocks `first_block`, `first_block + 1`, ...: its first `num_computed`
        tokens' KV taken as cached, the rest this step's new tokens (a step leaves it as it was)."""
        seq = Sequence(list(token_ids), self.config.block_size)
        seq.block_table = list(range(first_block, first_block + seq.num_blocks))
        seq.num_computed_tokens = num_computed
        return ScheduledSeq(seq, len(seq) - num_computed)

    def run(self, step: list[ScheduledSeq], numerics: str | None = None) -> torch.Tensor:
        """One forward step over placed sequences, as `numerics`' step (default: the config's): the
        float32 logits `[len(step), V]` of each sequence's last token."""
        return self._runner.run(step, numerics=numerics).logits
