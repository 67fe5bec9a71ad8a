"""Per-request sampling: parameters, logits processing, token choice and logprobs.

Processing order follows vLLM: grammar mask, repetition penalty, frequency/presence penalties, then
greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw from the row's generator.

Logprobs are those of the raw model distribution, `log_softmax` of the logits as they come out of
the model, before the grammar mask, penalties or temperature (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from onboard.engine.logprobs import MAX_LOGPROBS, check_num_logprobs, num_top

# Below this a temperature is treated as 0 (greedy); dividing by it would overflow (vLLM's eps).
_GREEDY_EPS = 1e-5

History = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, output token ids)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # 0 or -1 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs to return; 0 -> only the sampled token's; -1 -> all
    # Top-N logprobs at every prompt position as well (vLLM's `prompt_logprobs`; -1 -> all): the
    # prompt is then computed afresh, never taken from the prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI accepts a single string
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, max_logprobs: int = MAX_LOGPROBS, vocab_size: int | None = None) -> None:
        """Raise `ValueError` with a one-line message naming the first bad field; `logprobs` and
        `prompt_logprobs` may not exceed `max_logprobs` (-1: no limit; see `check_num_logprobs`)."""
        # `not (lo <= x <= hi)` also rejects NaN.
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        check_num_logprobs("logprobs", self.logprobs, max_logprobs, vocab_size)
        check_num_logprobs("prompt_logprobs", self.prompt_logprobs, max_logprobs, vocab_size)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    def make_generator(self) -> torch.Generator | None:
        """The request's RNG (on the CPU, where sampling draws): create once per request so
        successive steps continue one stream."""
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # raw-model logprob of the sampled token; None where not requested
    top_logprobs: list[list[tuple[int, float]] | None]  # best N (token, logprob), descending
    entropies: list[float | None]  # entropy (nats) of the raw-model distribution, where logprobs were asked

    def logprob_entry(self, row: int) -> dict | None:
        """{"token", "logprob", "top", "entropy"} for one row, or None where logprobs were not requested."""
        if self.logprobs[row] is None:
            return None
        return {
            "token": self.token_ids[row],
            "logprob": self.logprobs[row],
            "top": self.top_logprobs[row],
            "entropy": self.entropies[row],
        }


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History]) -> None:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties, in place."""
    vocab = logits.shape[-1]
    for row, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        if not p.needs_penalties:
            continue
        x = logits[row]
        out = torch.as_tensor(list(output), dtype=torch.long, device=x.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            seen[torch.as_tensor(list(prompt), dtype=torch.long, device=x.device)] = True
            seen[out] = True
            penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x.copy_(torch.where(seen, penalized, x))
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and out.numel():
            counts = torch.bincount(out, minlength=vocab).to(x.dtype)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def apply_masks(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> None:
    """Set the logits of tokens outside each row's allowed mask to -inf, in place."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    allowed = torch.stack([masks[i] for i in rows]).to(device=logits.device, dtype=torch.bool)
    if allowed.shape[-1] != logits.shape[-1]:
        raise ValueError(f"grammar mask covers {allowed.shape[-1]} tokens, logits have {logits.shape[-1]}")
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_filters(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p over [S, V] logits; filtered tokens get -inf.

    `top_k` <= 0 and `top_p` >= 1 mean off. Top-p renormalizes after top-k and always keeps the
    most likely token; min-p drops tokens with p < min_p * p_max after both.
    """
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1).any())
    if use_k or use_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if use_k:
            k = torch.where(top_k > 0, top_k, vocab)
            ranks = torch.arange(vocab, device=logits.device)
            sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], float("-inf"))
        if use_p:
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # top_p == 1 must keep everything even when the float cumsum overshoots 1.
            p = torch.where(top_p < 1, top_p, torch.inf)
            sorted_logits.masked_fill_(mass_before > p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[History],
        generators: Sequence[torch.Generator | None],
        masks: Sequence[torch.Tensor | None],
    ) -> SampleOutput:
        """Choose one token per row of `logits` [B, V]; `logits` itself is left untouched."""
        batch = logits.shape[0]
        if not len(params) == len(histories) == len(generators) == len(masks) == batch:
            raise ValueError("params, histories, generators and masks must have one entry per logits row")
        raw = logits.float()
        x = self.processed(raw, params, histories, masks)

        token_ids = torch.empty(batch, dtype=torch.long, device=x.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        rand = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(greedy) == batch:
            token_ids = x.argmax(dim=-1)
        elif greedy:
            index = torch.tensor(greedy, device=x.device)
            token_ids[index] = x[index].argmax(dim=-1)
        if rand:
            token_ids[torch.tensor(rand, device=x.device)] = self._sample_random(x, params, generators, rand)
        ids = token_ids.tolist()
        return SampleOutput(ids, *self._logprobs(raw, params, ids))

    def logprobs(self, raw: torch.Tensor, params: Sequence[SamplingParams], ids: list[int]) -> SampleOutput:
        """What `sample` reports for tokens chosen elsewhere (speculative verification)."""
        return SampleOutput(ids, *self._logprobs(raw.float(), params, ids))

    @staticmethod
    def processed(
        raw: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[History],
        masks: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """float32 logits after the grammar masks and penalties (a copy when anything applies)."""
        if not any(m is not None for m in masks) and not any(p.needs_penalties for p in params):
            return raw
        x = raw.clone()
        apply_masks(x, masks)
        apply_penalties(x, params, histories)
        return x

    @staticmethod
    def probabilities(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distributions sampling draws from: temperature, top-k, top-p, min-p over `x` [S, V]
        (logits already masked and penalised), softmaxed."""

        def column(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=x.device)

        filtered = apply_filters(
            x,
            column("temperature", torch.float32),
            column("top_k", torch.long),
            column("top_p", torch.float32),
            column("min_p", torch.float32),
        )
        return filtered.softmax(dim=-1)

    @classmethod
    def _sample_random(
        cls,
        x: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        rows: list[int],
    ) -> torch.Tensor:
        probs = cls.probabilities(x[torch.tensor(rows, device=x.device)], [params[i] for i in rows])
        out = torch.empty(len(rows), dtype=torch.long, device=x.device)
        unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
        if unseeded:
            index = torch.tensor(unseeded, device=x.device)
            out[index] = torch.multinomial(probs[index], 1).squeeze(-1)
        for j, i in enumerate(rows):
            g = generators[i]
            if g is not None:
                out[j] = torch.multinomial(probs[j].to(g.device), 1, generator=g).item()
        return out

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, params: Sequence[SamplingParams], ids: list[int]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None], list[float | None]]:
        logprobs: list[float | None] = [None] * len(ids)
        top: list[list[tuple[int, float]] | None] = [None] * len(ids)
        entropies: list[float | None] = [None] * len(ids)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return logprobs, top, entropies
        lp = raw[torch.tensor(rows, device=raw.device)].log_softmax(dim=-1)
        entropy = (-(lp.exp() * lp).nan_to_num().sum(dim=-1)).tolist()  # -inf logprobs: 0 * -inf -> 0
        vocab = lp.shape[-1]
        n_max = max(num_top(params[i].logprobs or 0, vocab) for i in rows)
        top_vals, top_ids = lp.topk(n_max, dim=-1) if n_max else (None, None)
        sampled = lp.gather(-1, torch.tensor([[ids[i]] for i in rows], device=raw.device)).squeeze(-1).tolist()
        for j, i in enumerate(rows):
            logprobs[i] = sampled[j]
            entropies[i] = entropy[j]
            n = num_top(params[i].logprobs or 0, vocab)
            top[i] = (
                list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True)) if top_ids is not None else []
            )
        return logprobs, top, entropies
