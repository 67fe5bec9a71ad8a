"""Turns one scheduled step into a forward pass over the paged KV cache: logits and aux states."""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from onboard.engine.attention import attention_backend
from onboard.engine.batch import ForwardBatch
from onboard.engine.config import EngineConfig
from onboard.engine.context import StepContext
from onboard.engine.kernel_measure import choose_kernels
from onboard.engine.kv_cache import KVCache
from onboard.engine.layers.residual import draft_input
from onboard.engine.models import model_class
from onboard.engine.scheduler import ScheduledSeq
from onboard.engine.state_cache import StateCache
from onboard.engine.weights import CheckpointWeights
from onboard.models.vlm import text_model_config


@dataclass
class StepResult:
    """float32 logits of the step's sampling and verification rows (in `prepare`'s order), the aux
    hidden states `[T, len(aux_layers) * H]` of every computed token (hyper-connection streams
    closed, `draft_input`; None when no aux layer was asked for), and per sequence scoring its
    prompt (seq_id ->) the float32 logits `[item.num_prompt_rows, V]` of its leading new tokens,
    each scoring the prompt token after it."""

    logits: torch.Tensor
    aux: torch.Tensor | None
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)


def logits_rows(item: ScheduledSeq) -> tuple[int, int]:
    """(prompt-scoring rows, sampling/verification rows) of one scheduled sequence: its first
    `num_prompt_rows` new tokens, then every new token when verifying proposals, else the last
    one when it samples. The two never overlap, and they are contiguous when both are there."""
    if item.num_proposals:
        return item.num_prompt_rows, item.num_new_tokens
    return item.num_prompt_rows, int(item.samples)


class ModelRunner:
    """Exact numerics run each scheduled sequence as its own forward, so every product has the
    rows transformers gives it for that request alone (a kernel may sum a row in another order
    at another row count): a request computes the same bits alone or batched, on any machine.
    Fast numerics run the step's rows together, through kernels chosen for batch invariance."""

    def __init__(self, path: Path, config: EngineConfig, dtype: torch.dtype = torch.bfloat16):
        self.config = config
        self.device = torch.device(config.device)
        self.hf_config = text_model_config(AutoConfig.from_pretrained(path))
        weights = CheckpointWeights(Path(path), dtype=dtype, device=self.device, fuse_linears=not self.exact)
        self.model = model_class(self.hf_config)(self.hf_config, weights)
        # Fast numerics: each weight shape's kernels, as measured on this machine (`kernels.py`).
        self.kernel_report = [] if self.exact else choose_kernels(self.model, config.batch_invariant)
        self.backend = attention_backend(self.device, config.attention_backend, config.numerics, config.batch_invariant)
        self.kv_layout = self.model.kv_layout
        self.cache = KVCache(self.kv_layout, config.num_blocks, config.block_size, self.device)
        # Linear attention's per-sequence state: a slot per running sequence (`state_cache.py`).
        self.state_layout = self.model.state_layout
        self.state = None
        if self.state_layout is not None:
            self.state = StateCache(self.state_layout, config.max_num_seqs, self.device)
        # seq_id -> {layer: [(conv, recurrent) after each verified position]} of the last step
        self.state_checkpoints: dict[int, dict[int, list]] = {}
        self.vocab_size = self.hf_config.get_text_config().vocab_size

    @property
    def exact(self) -> bool:
        return self.config.numerics == "exact"

    def prepare(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        """The step's inputs.  Logits rows, sequence by sequence in position order (`logits_rows`):
        the new tokens scoring the next prompt token (prompt logprobs), then the last token of a
        sampling sequence, or every new token of one verifying draft proposals."""
        block_size = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables, logits_indices, decoding = [], [], [], [], []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            first_row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            tables.append(table)
            decoding.append(start >= seq.num_prompt_tokens)
            num_prompt, num_sampled = logits_rows(item)
            logits_indices.extend(range(first_row, first_row + num_prompt))
            logits_indices.extend(range(len(input_ids) - num_sampled, len(input_ids)))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return ForwardBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            logits_indices=as_tensor(logits_indices),
            block_size=block_size,
            decoding=decoding,
            state_slots=[item.seq.state_slot for item in scheduled],
        )

    def context(
        self,
        batch: ForwardBatch,
        aux_layers: tuple[int, ...] = (),
        trace: dict | None = None,
        numerics: str | None = None,
    ) -> StepContext:
        return StepContext(
            cache=self.cache,
            backend=self.backend,
            attn=self.backend.build_metadata(batch),
            positions=batch.positions.to(self.device, non_blocking=True),
            aux_layers=aux_layers,
            numerics=numerics or self.config.numerics,
            trace=trace,
            state=self.state,
        )

    @torch.inference_mode()
    def run(
        self, scheduled: list[ScheduledSeq], aux_layers: tuple[int, ...] = (), numerics: str | None = None
    ) -> StepResult:
        """One step; `numerics` (default `config.numerics`) runs it as that numerics' step over
        this model as built (`StepBench` compares the two on one model)."""
        numerics = numerics or self.config.numerics
        if numerics == "exact" and len(scheduled) > 1:
            parts = [self.run([item], aux_layers, numerics) for item in scheduled]
            return StepResult(
                torch.cat([p.logits for p in parts]),
                torch.cat([p.aux for p in parts]) if aux_layers else None,
                {seq_id: rows for p in parts for seq_id, rows in p.prompt_logits.items()},
            )
        batch, out = self._forward(scheduled, aux_layers, None, numerics)
        aux = draft_input(out.aux_hidden_states) if aux_layers else None
        if len(batch.logits_indices) == 0:
            return StepResult(torch.empty(0, self.vocab_size), aux)
        # One projection over all rows, in position order, so a prompt scored in one chunk gets
        # exactly what `LLMEngine.score` computes.
        logits = self.model.compute_logits(out.hidden[batch.logits_indices])
        if not any(item.num_prompt_rows for item in scheduled):
            return StepResult(logits, aux)
        sampled, prompt_logits, row = [], {}, 0
        for item in scheduled:
            num_prompt, num_sampled = logits_rows(item)
            if num_prompt:
                prompt_logits[item.seq.seq_id] = logits[row : row + num_prompt]
            sampled.extend(range(row + num_prompt, row + num_prompt + num_sampled))
            row += num_prompt + num_sampled
        return StepResult(logits[torch.tensor(sampled, dtype=torch.long, device=logits.device)], aux, prompt_logits)

    @torch.inference_mode()
    def forward_hidden(self, scheduled: list[ScheduledSeq], aux_layers: tuple[int, ...] = (), trace=None):
        """Final hidden states `[T, H]` of every computed token and the aux layers' inputs."""
        if self.exact and len(scheduled) > 1:
            parts = [self.forward_hidden([item], aux_layers, trace) for item in scheduled]
            aux = [torch.cat([p[1][i] for p in parts]) for i in range(len(aux_layers))]
            return torch.cat([p[0] for p in parts]), aux
        _, out = self._forward(scheduled, aux_layers, trace)
        return out.hidden, out.aux_hidden_states

    def _forward(
        self,
        scheduled: list[ScheduledSeq],
        aux_layers: tuple[int, ...],
        trace: dict | None,
        numerics: str | None = None,
    ):
        batch = self.prepare(scheduled)
        ctx = self.context(batch, aux_layers, trace, numerics)
        if self.state is not None and any(item.num_proposals for item in scheduled):
            ctx.tables["state_checkpoints"] = {}
        out = self.model.forward(batch, ctx)
        for index, kept in ctx.tables.get("state_checkpoints", {}).items():
            self.state_checkpoints[scheduled[index].seq.seq_id] = kept
        return batch, out

    def keep_state(self, seq, num_tokens: int) -> None:
        """After verifying draft tokens: `seq`'s state as it was after the first `num_tokens` of
        the step's tokens (its last emitted token and the accepted proposals)."""
        kept = self.state_checkpoints.pop(seq.seq_id, None)
        if kept is None:
            return
        for layer, positions in kept.items():
            conv, recurrent = positions[num_tokens - 1]
            self.state.get("conv", layer)[seq.state_slot].copy_(conv[0])
            self.state.get("recurrent", layer)[seq.state_slot].copy_(recurrent[0])
