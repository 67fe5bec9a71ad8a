"""Speculative decoding with a draft (EAGLE-3, or the checkpoint's own MTP layers), inside the
engine's scheduled steps.  A draft reads the target's states at `aux_layer_ids` (`project` fuses
them), keeps its keys in its own cache (`new_cache`) and proposes from `step`.

Per running sequence the draft keeps its own small KV cache, fed after every step with the
target's auxiliary states at the positions the step computed (prefill chunks and verified
tokens alike).  A decode step then becomes: the draft proposes up to K tokens (its first from the
target's states, the rest from its own output state; grammar-constrained requests propose only
tokens their matcher allows, and the matcher is rolled back afterwards), the target computes the
last token plus the proposals in the same batched forward as every other scheduled sequence, and

* greedy: the longest prefix equal to the target's own choices (grammar mask and penalties
  applied per row, as plain decoding applies them) is accepted, and the target's next token is
  emitted after it;
* sampling (temperature > 0): proposal j is accepted with probability min(1, p_j / q_j) (p the
  target's distribution exactly as the sampler would draw from it, q the draft's), the first
  rejection is replaced by a draw from the normalised residual max(0, p - q), and when all are
  accepted a bonus token is drawn from p.  The emitted tokens are distributed exactly as sampling
  the target alone (Leviathan et al., Chen et al. 2023); randomness comes from the request's
  seeded generator.

Rejected tokens are rolled back: their cache slots are released (`BlockManager.truncate`) and
rewritten later; the draft's cache is cut back to the target's verified positions.  Positions a
prefix-cache hit skipped are not fed to the draft (it attends only to what its request computed),
which costs acceptance, never correctness.
"""

import copy
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from onboard.engine.sampler import Sampler, SamplingParams


@dataclass
class DraftState:
    """One sequence's draft: cache rows for target positions [start, fed); the last row's outputs."""

    cache: DynamicCache
    start: int
    fed: int
    logits: torch.Tensor | None = None  # draft-vocabulary logits proposing the token at `fed + 1`
    hidden: torch.Tensor | None = None  # [1, 1, H] the last row's output state


@dataclass
class Proposal:
    tokens: list[int]
    qs: list[torch.Tensor | None]  # per token, when sampling: the draft distribution over target ids
    masks: list[torch.Tensor | None]  # per verification row (len(tokens) + 1): the grammar's allowed ids


@dataclass
class SpecStats:
    """Counters as vLLM's /metrics names them (spec_decode_num_*)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class Verdict:
    accepted: int
    tokens: list[int]  # accepted proposals, then the target's own token


class Speculator:
    def __init__(self, draft, num_speculative_tokens: int, dtype: torch.dtype | None = None):
        """`dtype`: what the draft runs in (a copy of it; vLLM runs drafts in the served model's dtype):
        a float32 draft reads twice the bytes of a bf16 one per proposal, on a memory-bound decode."""
        if dtype is not None and next(p for p in draft.parameters()).dtype != dtype:
            draft = copy.deepcopy(draft).to(dtype)
        self.draft = draft.eval()
        self.k = num_speculative_tokens
        self.aux_layers = tuple(draft.aux_layer_ids)
        self.dtype = next(p for p in draft.parameters()).dtype
        self.draft_ids = torch.nonzero(draft.t2d).squeeze(1)  # draft index -> target id
        self.vocab_size = draft.t2d.shape[0]
        self.states: dict[int, DraftState] = {}
        self.stats = SpecStats(accepted_per_position=[0] * num_speculative_tokens)

    # -- the draft's cache ----------------------------------------------------------------------

    def ready(self, seq) -> bool:
        state = self.states.get(seq.seq_id)
        return state is not None and state.fed == len(seq) - 1

    def drop(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    @torch.inference_mode()
    def feed(self, seq, first: int, aux: torch.Tensor) -> None:
        """The target's auxiliary states `aux` [n, A*H] at positions first..first+n-1 of `seq`,
        whose next tokens are known: run the draft over them (row i: state at i, token at i+1)."""
        state = self.states.get(seq.seq_id)
        if state is None or state.fed != first:  # new, preempted, or past a prefix-cache hit
            state = self.states[seq.seq_id] = DraftState(self.draft.new_cache(), first, first)
        else:
            surplus = state.cache.get_seq_length() - (state.fed - state.start)
            if surplus > 0:  # rows of the draft's own proposals
                state.cache.crop(-surplus)
        n = aux.shape[0]
        tokens = seq.token_ids[first + 1 : first + 1 + n]
        logits, hidden = self._rows(tokens, self.draft.project(aux[None].to(self.dtype)), first + 1, state.cache)
        state.fed, state.logits, state.hidden = first + n, logits, hidden

    def _rows(self, tokens: list[int], hidden: torch.Tensor, first_position: int, cache: DynamicCache):
        """Draft rows for `tokens` at positions first_position..; the last row's logits and state."""
        device = hidden.device  # the draft's: its inputs are built there, not on the host
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(first_position, first_position + len(tokens), device=device)[None]
        mask = None
        if len(tokens) > 1:
            past = cache.get_seq_length()
            mask = torch.ones(len(tokens), past + len(tokens), dtype=torch.bool, device=device).tril(past)[None, None]
        out = self.draft.step(ids, hidden, positions, mask, cache)
        return out.logits[0, -1], out.hidden[:, -1:]

    # -- proposing ------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seq, limit: int, params: SamplingParams, generator, grammar) -> Proposal:
        """Up to `limit` chained proposals for `seq` (fewer where the grammar allows none)."""
        state = self.states[seq.seq_id]
        logits, hidden = state.logits, state.hidden
        proposal = Proposal([], [], [])
        for step in range(limit):
            if step:
                logits, hidden = self._rows([proposal.tokens[-1]], hidden, len(seq) + step - 1, state.cache)
            mask = None
            if grammar is not None:
                if grammar.is_terminated():
                    break
                mask = grammar.allowed_mask(self.vocab_size)
                allowed = mask[self.draft_ids]
                if not bool(allowed.any()):
                    break
                logits = logits.masked_fill(~allowed, float("-inf"))
            token, q = self._choose(logits, params, generator)
            proposal.masks.append(mask)
            proposal.tokens.append(token)
            proposal.qs.append(q)
            if grammar is not None:
                grammar.accept(token)
        if grammar is not None:
            proposal.masks.append(None if grammar.is_terminated() else grammar.allowed_mask(self.vocab_size))
            grammar.rollback(len(proposal.tokens))
        else:
            proposal.masks.append(None)
        return proposal

    def _choose(self, draft_logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
        if params.is_greedy:
            return int(self.draft_ids[draft_logits.argmax()]), None
        q_draft = (draft_logits.float() / params.temperature).softmax(-1)
        index = int(torch.multinomial(q_draft, 1, generator=generator))
        q = torch.zeros(self.vocab_size).index_copy_(0, self.draft_ids, q_draft)
        return int(self.draft_ids[index]), q

    # -- verifying ------------------------------------------------------------------------------

    def verify(self, raw: torch.Tensor, proposal: Proposal, params: SamplingParams, history, generator) -> Verdict:
        """`raw` [len(tokens) + 1, V] float32 target logits of the last token and each proposal;
        `history` (prompt ids, output ids) before the proposals."""
        tokens = proposal.tokens
        prompt, output = history
        rows = len(tokens) + 1
        histories = [(prompt, [*output, *tokens[:j]]) for j in range(rows)]
        x = Sampler.processed(raw, [params] * rows, histories, proposal.masks)
        if params.is_greedy:
            target = x.argmax(-1).tolist()
            accepted = 0
            while accepted < len(tokens) and tokens[accepted] == target[accepted]:
                accepted += 1
            verdict = Verdict(accepted, [*tokens[:accepted], target[accepted]])
        else:
            verdict = self._rejection_sample(Sampler.probabilities(x, [params] * rows), proposal, generator)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(tokens)
        stats.num_accepted_tokens += verdict.accepted
        for j in range(verdict.accepted):
            stats.accepted_per_position[j] += 1
        return verdict

    @staticmethod
    def _rejection_sample(p: torch.Tensor, proposal: Proposal, generator) -> Verdict:
        for j, (token, q) in enumerate(zip(proposal.tokens, proposal.qs, strict=True)):
            if float(torch.rand((), generator=generator)) < float(p[j, token] / q[token]):
                continue
            residual = (p[j] - q).clamp(min=0)
            total = residual.sum()
            fallback = residual / total if total > 0 else p[j]  # p == q: any draw from p is exact
            return Verdict(j, [*proposal.tokens[:j], int(torch.multinomial(fallback, 1, generator=generator))])
        n = len(proposal.tokens)
        return Verdict(n, [*proposal.tokens, int(torch.multinomial(p[n], 1, generator=generator))])
