"""Throughput: the engine in fast numerics against `transformers.generate` (greedy, EOS never stops
either side) at each concurrency, on random prompts (the `throughput` phase)."""

from __future__ import annotations

import time

import torch

from .context import CheckContext
from .model import greedy, random_prompts
from .settings import PAD_ID


class ThroughputPhase(CheckContext):
    """The `throughput` phase."""

    @torch.inference_mode()
    def _hf_generate(self, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        ids = torch.tensor(prompts, device=self.device)
        return self.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
        )[:, ids.shape[1] :]

    def throughput(self) -> None:
        s = self.s
        self.report["throughput"] = None
        self.hf_as(torch.bfloat16)
        engine = self.engine("fast", torch.bfloat16)
        warm = random_prompts(2, s.prompt_tokens, self.shape.vocab_size, s.seed + 99)
        engine.generate(warm, greedy(4))
        self._hf_generate(warm, 4)
        rows = []
        for c in s.concurrency:
            prompts = random_prompts(c, s.prompt_tokens, self.shape.vocab_size, s.seed + 100 + c)
            preemptions = engine.stats()["num_preemptions"]
            self.sync()
            began = time.monotonic()
            outs = engine.generate(prompts, greedy(s.new_tokens))
            self.sync()
            engine_s = time.monotonic() - began
            engine_tokens = sum(len(o.token_ids) for o in outs)
            began = time.monotonic()
            hf_out = self._hf_generate(prompts, s.new_tokens)
            self.sync()
            hf_s = time.monotonic() - began
            hf_tokens = hf_out.numel()
            hf_rows = hf_out.tolist()
            engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
            rows.append(
                {
                    "concurrency": c,
                    "engine_tokens": engine_tokens,
                    "engine_s": round(engine_s, 3),
                    "engine_tps": engine_tps,
                    "hf_tokens": hf_tokens,
                    "hf_s": round(hf_s, 3),
                    "hf_tps": hf_tps,
                    "ratio": engine_tps / hf_tps,
                    # Fast numerics against bf16 transformers, batched: informative, not a criterion.
                    "same_greedy_outputs": sum(o.token_ids == h for o, h in zip(outs, hf_rows, strict=True)) / c,
                    "engine_preemptions": engine.stats()["num_preemptions"] - preemptions,
                }
            )
            self.report["throughput"] = {
                "numerics": "fast",
                "dtype": "bfloat16",
                "prompt_tokens": s.prompt_tokens,
                "new_tokens": s.new_tokens,
                "results": rows,
            }
