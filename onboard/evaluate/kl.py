"""KL-divergence statistics of a quantized model's next-token distributions (llama.cpp's set).

Fed one chunk of positions at a time, so memory stays at [chunk x vocab] whatever the data
size; only one float per position per statistic is kept.

Two estimators, one per-token function each: `token_kl` when the candidate's whole distribution
is known (in-process, or a server returning the full vocabulary), `partition_kl` when a server
returns only its top-k log-probabilities. The latter is KL between the two distributions
coarsened to {the returned tokens, one bucket for the rest}: by the data-processing inequality
it is at most the true KL, and equal to it when the returned tokens are the whole vocabulary.
"""

import math

import numpy as np
import torch


def token_kl(ref_logp: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per row, float32, from the reference's log-probabilities and the
    candidate's logits (or log-probabilities) [n, vocab]: Σ p (log p - log q), 0 log 0 = 0."""
    ref_logp = ref_logp.float()
    cand_logp = torch.log_softmax(cand_logits.float(), dim=-1)
    p = ref_logp.exp()
    # p = 0 terms are 0 by convention (0 * -inf would be nan for masked-out tokens).
    return torch.where(p > 0, p * (ref_logp - cand_logp), 0.0).sum(-1).clamp_min(0.0)


def partition_kl(ref_logp: torch.Tensor, token_ids: torch.Tensor, cand_logp: torch.Tensor) -> torch.Tensor:
    """KL per row over the partition {returned tokens} + {rest}: reference log-probabilities
        [n, vocab], the candidate's returned token ids [n, m] (-1 = padding) and their log-probabilities
        [n, m]. A lower bound of the true KL; equal to it when the m tokens are the whole vocabulary.
    Computed in float64 (the rest bucket is a difference of near-equal sums), returned in float32."""
    present = token_ids >= 0
    ids = token_ids.clamp_min(0)
    ref = ref_logp.double()
    p_known = torch.where(present, ref.gather(-1, ids), -torch.inf)
    q_known = torch.where(present, cand_logp.double(), -torch.inf)
    kl = torch.where(present, p_known.exp() * (p_known - q_known), 0.0).sum(-1)
    # The rest bucket: the reference's exactly (logsumexp of what was not returned), the candidate's
    # as 1 - its returned mass, floored where rounding leaves nothing.
    returned = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, ids, present)
    p_rest = torch.logsumexp(ref.masked_fill(returned, -torch.inf), dim=-1)
    q_rest = torch.log((1.0 - q_known.exp().sum(-1)).clamp_min(1e-12))
    rest = torch.where(torch.isfinite(p_rest), p_rest.exp() * (p_rest - q_rest), 0.0)
    return (kl + rest).clamp_min(0.0).float()


class KLStats:
    """Accumulates KL(reference || quantized) and friends over chunks of positions."""

    def __init__(self) -> None:
        self._kl: list[torch.Tensor] = []
        self._same_top: list[torch.Tensor] = []
        self._delta_p: list[torch.Tensor] = []
        self._nll_ref: list[torch.Tensor] = []
        self._nll_quant: list[torch.Tensor] = []

    def update(self, ref_logits: torch.Tensor, quant_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Add positions: logits [n, vocab], targets [n] (the actual next tokens). Returns the KLs."""
        ref = torch.log_softmax(ref_logits.float(), dim=-1)
        quant = torch.log_softmax(quant_logits.float(), dim=-1)
        top = ref.argmax(-1, keepdim=True)
        return self._add(
            token_kl(ref, quant_logits),
            quant.argmax(-1, keepdim=True) == top,
            quant.gather(-1, top).exp() - ref.gather(-1, top).exp(),
            -ref.gather(-1, targets[:, None]),
            -quant.gather(-1, targets[:, None]),
        )

    def update_scored(
        self,
        ref_logits: torch.Tensor,
        token_ids: torch.Tensor,
        cand_logp: torch.Tensor,
        cand_target_logp: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """Add positions where the candidate is known only by the tokens a server returned ([n, m]
        ids, -1 padded, and their log-probabilities) and the actual next token's log-probability.
        The reference's top token, when the server did not return it, has at most the smallest
        returned probability: that bound stands in for it in Δp."""
        ref = torch.log_softmax(ref_logits.float(), dim=-1)
        top = ref.argmax(-1, keepdim=True)
        cand_logp = cand_logp.double()
        # Tied top log-probabilities go to the lowest token id, as argmax over a vocabulary does
        # in process: a server lists tied tokens in its sort's order, which differs by kernel.
        returned = token_ids >= 0
        best = cand_logp.masked_fill(~returned, -torch.inf).amax(-1, keepdim=True)
        tied = returned & (cand_logp == best)
        cand_top = torch.where(tied, token_ids, torch.iinfo(token_ids.dtype).max).amin(-1, keepdim=True)
        hit = token_ids == top
        smallest = cand_logp.masked_fill(token_ids < 0, torch.inf).amin(-1)
        q_top = torch.where(hit.any(-1), torch.where(hit, cand_logp, -torch.inf).amax(-1), smallest)
        return self._add(
            partition_kl(ref, token_ids, cand_logp),
            cand_top == top,
            (q_top.exp()[:, None] - ref.gather(-1, top).exp().double()).float(),
            -ref.gather(-1, targets[:, None]),
            -cand_target_logp.float()[:, None],
        )

    def _add(self, kl, same_top, delta_p, nll_ref, nll_quant) -> torch.Tensor:
        self._kl.append(kl)
        self._same_top.append(same_top)
        self._delta_p.append(delta_p)
        self._nll_ref.append(nll_ref)
        self._nll_quant.append(nll_quant)
        return kl

    @property
    def num_tokens(self) -> int:
        return sum(len(k) for k in self._kl)

    def kl_values(self) -> np.ndarray:
        return torch.cat(self._kl).double().numpy() if self._kl else np.zeros(0)

    def histogram(self, bins_per_decade: int = 4) -> dict[str, list]:
        """Counts of per-token KL in log-spaced bins from 1e-4 to the decade above the max (values
        below 1e-4 fall in the first bin): the shape behind the mean, for the report."""
        kl = self.kl_values()
        top = max(1, math.ceil(math.log10(max(float(kl.max(initial=0.0)), 1e-4))))
        edges = np.logspace(-4, top, (top + 4) * bins_per_decade + 1)
        edges[0] = 0.0
        counts, _ = np.histogram(kl, bins=edges)
        return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}

    def summary(self) -> dict[str, float | int]:
        if not self._kl:
            raise ValueError("no positions were evaluated")
        kl = self.kl_values()
        return {
            "mean_kld": float(kl.mean()),
            "median_kld": float(np.median(kl)),
            "p90_kld": float(np.percentile(kl, 90)),
            "p99_kld": float(np.percentile(kl, 99)),
            "max_kld": float(kl.max()),
            "top1_agreement": float(torch.cat(self._same_top).double().mean()),
            "rms_delta_p": float(torch.cat(self._delta_p).double().pow(2).mean().sqrt()),
            "ppl_reference": math.exp(float(torch.cat(self._nll_ref).double().mean())),
            "ppl_quantized": math.exp(float(torch.cat(self._nll_quant).double().mean())),
            "num_tokens": len(kl),
        }
