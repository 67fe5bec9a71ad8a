"""What every linear-attention layer does with its per-sequence state (Gated DeltaNet, KDA).

Per token a family projects the input into a depthwise causal conv1d's channels (q, k and v side
by side) and into its gates; the conv's last `kernel` inputs are the sequence's conv state
(`conv`), and a delta rule updates an fp32 recurrent state (`recurrent`) of its heads.  Each
sequence runs as transformers runs it with a cache: its first step (a prompt, or its first chunk)
by the chunked rule from a zero state; a later chunk by the chunked rule from the stored state,
its conv over the stored window and the new inputs; one decode token by the recurrent rule and the
conv's one-step update.  A decoding sequence verifying draft tokens advances token by token as
that many decode steps would, and keeps each position's state so a rejection can roll back
(`state_cache.py`).  A decode step (every sequence one token) runs as one batch.

A family's gates are computed per call on the rows that call covers, never once for the step and
sliced: an elementwise kernel may round an element otherwise at another length (a vectorised
exp against its scalar tail), and transformers computes them per forward.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from onboard.engine.context import StepContext


class LinearAttention(torch.nn.Module):
    """The per-sequence plumbing; a family supplies

    * `project(x)` -> (the conv's input `[T, conv dim]`, the per-token gate inputs, each `[T, ...]`);
    * `gates(*inputs)` on `[B, n, ...]` rows -> (beta, g) as its rules take them;
    * `split_heads(mixed)` `[B, n, conv dim]` after the conv -> q, k, v `[B, n, heads, dim]`;
    * `finish(core, x)`: the rule's output `[T, heads, value dim]` -> the layer's `[T, H]`;
    * the rules and the conv as transformers' torch functions (class attributes)."""

    chunk_rule: Callable
    recurrent_rule: Callable
    conv_prefill: Callable
    conv_step: Callable

    def __init__(self, layer_idx: int, kernel: int, activation: str, conv_weight: torch.Tensor):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel = kernel
        self.activation = activation
        self.conv_weight = torch.nn.Parameter(conv_weight, requires_grad=False)  # [conv dim, kernel]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    def gates(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def finish(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        mixed, inputs = self.project(x)
        conv_states = ctx.state.get("conv", self.layer_idx)
        states = ctx.state.get("recurrent", self.layer_idx)
        seqs = ctx.tables["state_seqs"]
        decoding = [seq for seq in seqs if seq.continues and seq.end - seq.start == 1]
        if len(decoding) == len(seqs) > 1:  # a decode step: every sequence's token in one batch
            return self.finish(self._decode_batch(mixed, inputs, conv_states, states, [s.slot for s in seqs]), x)
        parts = []
        for seq in seqs:
            rows = slice(seq.start, seq.end)
            conv_state, state = conv_states[seq.slot : seq.slot + 1], states[seq.slot : seq.slot + 1]
            if seq.verifying:  # as that many decode steps, each position's state kept
                outs, kept = [], []
                for row in range(seq.start, seq.end):
                    one = slice(row, row + 1)
                    outs.append(self._decode(mixed[one], [t[one] for t in inputs], conv_state, state))
                    kept.append((conv_state.clone(), state.clone()))
                ctx.tables["state_checkpoints"].setdefault(seq.index, {})[self.layer_idx] = kept
                parts.append(torch.cat(outs))
            elif seq.continues and seq.end - seq.start == 1:
                parts.append(self._decode(mixed[rows], [t[rows] for t in inputs], conv_state, state))
            else:
                rows_in = [t[rows] for t in inputs]
                parts.append(self._prefill(mixed[rows], rows_in, conv_state, state, seq.continues))
        return self.finish(torch.cat(parts) if len(parts) > 1 else parts[0], x)

    def _prefill(self, mixed, inputs, conv_state, state, continues: bool) -> torch.Tensor:
        n = mixed.shape[0]
        columns = mixed.T[None]  # [1, conv dim, n]
        if continues:
            window = torch.cat([conv_state, columns], dim=-1)
        else:  # transformers pads a first step shorter than the kernel before storing its window
            window = F.pad(columns, (self.kernel - n, 0)) if n < self.kernel else columns
        conv_state.copy_(window[..., -self.kernel :])
        mixed = self.conv_prefill(window, self.conv_weight, None, activation=self.activation)[:, :, -n:]
        query, key, value = self.split_heads(mixed.transpose(1, 2))
        beta, g = self.gates(*(t[None] for t in inputs))
        out, final = self.chunk_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=state if continues else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        state.copy_(final)
        return out[0]

    def _decode_batch(self, mixed, inputs, conv_states, states, slots: list[int]) -> torch.Tensor:
        """One decode token of each of B sequences, batched: the conv and the rule compute each
        batch row on its own (no reduction across rows), so a row's bits are its lone decode's."""
        index = torch.tensor(slots, dtype=torch.long, device=mixed.device)
        conv_state, state = conv_states.index_select(0, index), states.index_select(0, index)
        out, final = self._recurrent(mixed[:, :, None], [t[:, None] for t in inputs], conv_state, state)
        conv_states.index_copy_(0, index, conv_state)
        states.index_copy_(0, index, final)
        return out[:, 0]

    def _decode(self, mixed, inputs, conv_state, state) -> torch.Tensor:
        out, final = self._recurrent(mixed.T[None], [t[None] for t in inputs], conv_state, state)
        state.copy_(final)
        return out[0]

    def _recurrent(self, columns, inputs, conv_state, state) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per batch row (`columns` `[B, conv dim, 1]`): the conv's step (updating
        `conv_state` in place) and the recurrent rule from `state`; (out, the new state)."""
        mixed = self.conv_step(columns, conv_state, self.conv_weight, None, self.activation)
        query, key, value = self.split_heads(mixed.transpose(1, 2))
        beta, g = self.gates(*inputs)
        return self.recurrent_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
