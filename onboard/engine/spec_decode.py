"""Chain speculative decoding of one sequence on the engine's paged cache (EAGLE-3 draft).

Each round: the draft proposes K tokens (its first from the target's auxiliary states, the rest
from its own output state), the target verifies them in ONE forward over the last emitted token
plus the K proposals, and then:

* greedy: the longest prefix equal to the target's own greedy choices is accepted and the
  target's next token is emitted as the bonus;
* sampling (temperature > 0): proposal j is accepted with probability min(1, p_j / q_j) (p the
  target's filtered distribution, q the draft's), the first rejection is replaced by a sample of
  the normalised residual max(0, p - q), and a bonus is sampled from p when all K are accepted.
  The emitted tokens are distributed exactly as sampling the target alone (Leviathan et al.,
  Chen et al. 2023); all randomness comes from the request's seeded generator.

Rejected tokens are rolled back: the target's tail blocks are freed and their cache slots
rewritten later; the draft's cache is cut back and replayed on the target's states for the
accepted positions.

Scope: concurrency 1, no prefix caching or grammars (the batched and structured variants of
issue #4 are not built yet).
"""

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from onboard.engine.sampler import SamplingParams, apply_filters
from onboard.engine.scheduler import ScheduledSeq
from onboard.engine.sequence import Sequence, SequenceStatus

TOP = 5  # top log-probabilities recorded per emitted token (the near-tie rule's)


@dataclass
class SpecResult:
    token_ids: list[int]
    accepted: list[int] = field(default_factory=list)  # per verify round: proposals accepted (0..K)
    top: list[list[int]] = field(default_factory=list)  # per emitted token: the target's top-5 ids there


class SpeculativeDecoder:
    def __init__(self, engine, draft, num_speculative_tokens: int):
        self.engine = engine
        self.draft = draft
        self.k = num_speculative_tokens
        self.aux_layers = tuple(draft.aux_layer_ids)
        self.dtype = next(p for p in draft.parameters()).dtype
        self.draft_ids = torch.nonzero(draft.t2d).squeeze(1)  # draft index -> target id

    def _target(self, seq: Sequence, num_new: int, verify: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward the last `num_new` tokens of `seq`: float32 logits [num_new, V] and aux states.
        `verify`: each token attends as a decode step would, so its logits are plain decoding's."""
        runner = self.engine.runner
        self.engine.block_manager.may_append(seq)
        batch = runner.prepare([ScheduledSeq(seq, num_new)], rowwise=verify)
        final = runner.model.forward(batch, runner.cache, aux_layers=self.aux_layers)
        aux = torch.cat(runner.model.aux_hidden_states, dim=-1).to(self.dtype)
        return runner.model.compute_logits(final), aux

    def _draft(self, tokens: list[int], aux: torch.Tensor | None, hidden, first_position: int, cache) -> tuple:
        """Draft rows for `tokens` at positions first_position.. ; the last row's draft-vocabulary
        logits and output state."""
        ids = torch.tensor([tokens])
        state = self.draft.project(aux[None]) if aux is not None else hidden
        positions = torch.arange(first_position, first_position + len(tokens))[None]
        mask = None
        if len(tokens) > 1:
            past = cache.get_seq_length()
            mask = torch.ones(len(tokens), past + len(tokens), dtype=torch.bool).tril(past)[None, None]
        out = self.draft.step(ids, state, positions, mask, cache)
        return out.logits[0, -1], out.hidden[:, -1:]

    def _target_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        rows = logits.shape[0]

        def column(value, dtype):
            return torch.full((rows,), value, dtype=dtype)

        filtered = apply_filters(
            logits,
            column(params.temperature, torch.float32),
            column(params.top_k, torch.long),
            column(params.top_p, torch.float32),
            column(params.min_p, torch.float32),
        )
        return filtered.softmax(-1)

    def _propose(self, draft_logits: torch.Tensor, params: SamplingParams, gen) -> tuple[int, torch.Tensor | None]:
        """A proposal (target id) and, when sampling, the draft's distribution over target ids."""
        if params.is_greedy:
            return int(self.draft_ids[draft_logits.argmax()]), None
        q_draft = (draft_logits / params.temperature).softmax(-1)
        index = int(torch.multinomial(q_draft, 1, generator=gen))
        q = torch.zeros(self.draft.t2d.shape[0]).index_copy_(0, self.draft_ids, q_draft)
        return int(self.draft_ids[index]), q

    def _verify(self, proposals, qs, logits, params: SamplingParams, gen) -> tuple[int, list[int]]:
        """How many proposals are accepted, and the tokens to emit (accepted ones + one more)."""
        if params.is_greedy:
            greedy = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < self.k and proposals[accepted] == greedy[accepted]:
                accepted += 1
            return accepted, [*proposals[:accepted], greedy[accepted]]
        p = self._target_probs(logits, params)
        for j, (token, q) in enumerate(zip(proposals, qs, strict=True)):
            ratio = p[j, token] / q[token]
            if float(torch.rand((), generator=gen)) < float(ratio):
                continue
            residual = (p[j] - q).clamp(min=0)
            total = residual.sum()
            fallback = residual / total if total > 0 else p[j]  # p == q: any draw from p is exact
            return j, [*proposals[:j], int(torch.multinomial(fallback, 1, generator=gen))]
        return self.k, [*proposals, int(torch.multinomial(p[self.k], 1, generator=gen))]

    @torch.inference_mode()
    def generate(
        self, prompt: list[int], max_tokens: int, eos_ids=frozenset(), params: SamplingParams | None = None
    ) -> SpecResult:
        params = params or SamplingParams(temperature=0.0)
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        engine = self.engine
        bm = engine.block_manager
        seq = Sequence(list(prompt), engine.config.block_size)
        bm.allocate(seq, reuse_prefix=False)
        result = SpecResult([])
        try:
            n = len(prompt)
            logits, aux = self._target(seq, n)
            seq.num_computed_tokens = n
            if params.is_greedy:
                token = int(logits[-1].argmax())
            else:
                token = int(torch.multinomial(self._target_probs(logits[-1:], params)[0], 1, generator=gen))
            seq.append_token(token)
            result.token_ids.append(token)
            result.top.append(logits[-1].topk(TOP).indices.tolist())
            cache = DynamicCache()
            # Draft rows 0..n-1: target states at 0..n-1, tokens at 1..n; the last row proposes n+1.
            draft_logits, hidden = self._draft([*prompt[1:], token], aux, None, 1, cache)
            while len(result.token_ids) < max_tokens and token not in eos_ids:
                base = len(seq) - 1  # position of the last emitted token (its KV not yet computed)
                proposals, qs = [], []
                for step in range(self.k):
                    if step:
                        draft_logits, hidden = self._draft([proposals[-1]], None, hidden, base + step, cache)
                    proposal, q = self._propose(draft_logits, params, gen)
                    proposals.append(proposal)
                    qs.append(q)
                seq.token_ids.extend(proposals)
                logits, aux = self._target(seq, 1 + self.k, verify=True)
                accepted, emitted = self._verify(proposals, qs, logits, params, gen)
                result.accepted.append(accepted)
                # Roll back: keep KV for the last token and the accepted proposals.
                del seq.token_ids[base + 1 :]
                seq.num_computed_tokens = base + 1 + accepted
                tops = logits[: len(emitted)].topk(TOP, dim=-1).indices.tolist()
                for t, top in zip(emitted, tops, strict=True):
                    seq.append_token(t)
                    result.token_ids.append(t)
                    result.top.append(top)
                    if t in eos_ids or len(result.token_ids) >= max_tokens:
                        break
                token = result.token_ids[-1]
                if len(result.token_ids) >= max_tokens or token in eos_ids:
                    break
                bm.truncate(seq)
                surplus = cache.get_seq_length() - base  # the draft's own rows past the target's states
                if surplus > 0:
                    cache.crop(-surplus)
                draft_logits, hidden = self._draft(emitted, aux[: accepted + 1], None, base + 1, cache)
            return SpecResult(result.token_ids[:max_tokens], result.accepted, result.top[:max_tokens])
        finally:
            bm.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
