"""KL-divergence statistics of a quantized model's next-token distributions (llama.cpp's set).

Fed one chunk of positions at a time, so memory stays at [chunk x vocab] whatever the data
size; only one float per position per statistic is kept.
"""

import math

import numpy as np
import torch


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
        p = ref.exp()
        # p = 0 terms are 0 by convention (0 * -inf would be nan for masked-out tokens).
        kl = torch.where(p > 0, p * (ref - quant), 0.0).sum(-1).clamp_min(0.0)
        top = ref.argmax(-1, keepdim=True)
        self._kl.append(kl)
        self._same_top.append(quant.argmax(-1, keepdim=True) == top)
        self._delta_p.append(quant.gather(-1, top).exp() - ref.gather(-1, top).exp())
        self._nll_ref.append(-ref.gather(-1, targets[:, None]))
        self._nll_quant.append(-quant.gather(-1, targets[:, None]))
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
