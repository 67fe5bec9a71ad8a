"""Speculative decoding's exactness: a random-weight EAGLE-3 draft on the engine must leave greedy
outputs as plain greedy decoding gives them (the `spec_exact` and `spec_fast` phases)."""

from __future__ import annotations

import time
from typing import Any

import torch

from .context import CheckContext
from .model import greedy, random_prompts
from .settings import Shape


def build_draft(engine, shape: Shape, dtype: torch.dtype, seed: int):
    """A random-weight EAGLE-3 draft for the engine's model, on its device: draft vocabulary a seeded
    random subset of `shape.draft_vocab_size` target ids, auxiliary layers 2, L//2 and L-3."""
    from onboard.speculator.data import default_aux_layers
    from onboard.speculator.draft import Eagle3Draft, draft_layer_config

    text = engine.hf_config.get_text_config()
    size = min(shape.draft_vocab_size, engine.vocab_size)
    ids = torch.randperm(engine.vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    torch.manual_seed(seed)
    with torch.device(engine.config.device):  # factory calls inside (set_vocab's arange too) land there
        draft = Eagle3Draft(draft_layer_config(engine.hf_config), size, default_aux_layers(text.num_hidden_layers))
        draft.set_vocab(ids.to(engine.config.device))
        target = engine.target_tensors()
        draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
        del target
    return draft.to(dtype).eval()


class SpecPhases(CheckContext):
    """The `spec_exact` and `spec_fast` phases."""

    def spec(self, numerics: str) -> None:
        dtype = torch.bfloat16
        self.report["spec"][numerics] = None
        engine = self.engine(numerics, dtype)
        prompts = random_prompts(self.s.spec_prompts, self.s.prompt_tokens, self.shape.vocab_size, self.s.seed + 2)
        params = greedy(self.s.spec_tokens)
        engine.set_speculator(None, 0)
        began = time.monotonic()
        plain = engine.generate(prompts, params)
        self.sync()
        plain_s = time.monotonic() - began
        draft = build_draft(engine, self.shape, dtype, self.s.seed)
        result: dict[str, Any] = {
            "numerics": numerics,
            "dtype": "bfloat16",
            "num_prompts": len(prompts),
            "new_tokens": self.s.spec_tokens,
            "num_speculative_tokens": self.s.spec_k,
            "draft_vocab_size": draft.draft_vocab_size,
            "aux_layer_ids": draft.aux_layer_ids,
        }
        engine.set_speculator(draft, self.s.spec_k)
        began = time.monotonic()
        spec = engine.generate(prompts, params)
        self.sync()
        spec_s = time.monotonic() - began
        stats = engine.speculator.stats
        engine.set_speculator(None, 0)
        del draft
        total = sum(len(p.token_ids) for p in plain)
        same = sum(
            a == b for s_, p in zip(spec, plain, strict=True) for a, b in zip(s_.token_ids, p.token_ids, strict=False)
        )
        matches = [s_.token_ids == p.token_ids for s_, p in zip(spec, plain, strict=True)]
        result.update(
            {
                "exact": all(matches),
                "prompt_match_rate": sum(matches) / len(matches),
                "token_match_rate": same / total if total else 0.0,
                "num_drafts": stats.num_drafts,
                "num_draft_tokens": stats.num_draft_tokens,
                "num_accepted_tokens": stats.num_accepted_tokens,
                "accepted_per_position": list(stats.accepted_per_position),
                # Tokens emitted per verification step (1 + accepted proposals per draft).
                "acceptance_length": 1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else None,
                "plain_s": round(plain_s, 3),
                "spec_s": round(spec_s, 3),
                "kv_blocks_all_free": engine.stats()["num_free_blocks"] == engine.config.num_blocks,
            }
        )
        self.report["spec"][numerics] = result
