"""Exact parity: the engine in exact numerics against transformers on the same weights, one prompt
at a time (greedy continuations under the near-tie rule, teacher-forced logits), and the bf16 and
fp32 parity phases of the random model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .context import CheckContext
from .model import greedy, random_prompts
from .settings import PAD_ID, TOP


class ParityPhases(CheckContext):
    """`token_parity`, shared with the artifacts' phases, and the `parity_bf16`/`parity_fp32` phases."""

    @torch.inference_mode()
    def _hf_greedy(self, prompt: list[int], max_new_tokens: int, model=None) -> tuple[list[int], list[list[int]]]:
        """transformers' greedy continuation of ONE copy of the prompt (batch 1), as a user runs it and
        as `onboard adapt` compares (`_reference_greedy`): exact numerics run transformers' own ops on
        the same rows, so a request alone computes what this computes; and the top-5 ids at each step."""
        model = self.hf if model is None else model
        out = model.generate(
            torch.tensor([prompt], device=self.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=self.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        return tokens, [step[0].float().topk(TOP).indices.tolist() for step in out.logits]

    def parity_prompts(self) -> list[list[int]]:
        """The random prompts every parity section uses (bf16, fp32 and both artifacts)."""
        return random_prompts(self.s.parity_prompts, self.s.prompt_tokens, self.shape.vocab_size, self.s.seed + 1)

    def token_parity(
        self,
        engine,
        model,
        prompts: list[list[int]],
        dtype: torch.dtype,
        on_forced: Callable[[list[int], torch.Tensor, torch.Tensor], None] | None = None,
    ) -> dict[str, Any]:
        """The engine (exact numerics) against transformers' `model` on the same weights, one prompt
        at a time: greedy continuations (near-tie rule at a divergence) and teacher-forced logits on
        prompt + transformers' continuation.  `on_forced(forced, reference, engine)` sees each
        prompt's teacher-forced logits (the distribution rule's statistics)."""
        from onboard.adapt.parity import compare_greedy

        params = greedy(self.s.parity_tokens, logprobs=TOP)
        max_diff, agree, positions, kl_sum, bitwise, cases = 0.0, 0, 0, 0.0, True, []
        for prompt in prompts:
            (mine,) = engine.generate([prompt], params)
            theirs, their_top = self._hf_greedy(prompt, self.s.parity_tokens, model)
            mine_top = [[token for token, _ in entry["top"]] for entry in mine.logprobs]
            verdict = compare_greedy(mine.token_ids, theirs, mine_top, their_top)
            forced = prompt + theirs
            ref = self._hf_logits(forced, model)
            got = engine.score(forced).float().to(ref.device)
            bitwise = bitwise and torch.equal(got, ref)
            max_diff = max(max_diff, float((got - ref).abs().max()))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            positions += ref.shape[0]
            ref_lp, got_lp = ref.log_softmax(-1), got.log_softmax(-1)
            kl_sum += float((ref_lp.exp() * (ref_lp - got_lp)).sum(-1).clamp_min(0).sum())
            if on_forced is not None:
                on_forced(forced, ref, got)
            cases.append(
                {
                    "matched": verdict.matched,
                    "first_divergence": verdict.first_divergence,
                    "near_tie": verdict.near_tie,
                }
            )
            del ref, got, ref_lp, got_lp
        greedy_match_rate = sum(c["matched"] for c in cases) / len(cases)
        # Every logit and every greedy token transformers' own; else judged by the near-tie rule.
        identical = bitwise and greedy_match_rate == 1.0
        return {
            "numerics": "exact",
            "dtype": str(dtype).removeprefix("torch."),
            "num_prompts": len(prompts),
            "prompt_tokens": self.s.prompt_tokens,
            "greedy_tokens": self.s.parity_tokens,
            "max_abs_logit_diff": max_diff,
            "bitwise_equal_logits": bitwise,
            "top1_agreement": agree / positions,
            "mean_kld": kl_sum / positions,
            "num_positions": positions,
            "greedy_match_rate": greedy_match_rate,
            "mean_matched_tokens": sum(
                self.s.parity_tokens if c["first_divergence"] is None else c["first_divergence"] for c in cases
            )
            / len(cases),
            "divergences_all_near_ties": all(c["near_tie"] for c in cases),
            "rule": "bitwise" if identical else "near_tie",
            "cases": cases,
        }

    def parity(self, dtype: torch.dtype) -> None:
        name = str(dtype).removeprefix("torch.")
        self.report["parity"][name] = None
        engine = self.engine("exact", dtype)  # frees the other engine first
        self.hf_as(dtype)
        self.report["parity"][name] = self.token_parity(engine, self.hf, self.parity_prompts(), dtype)
