"""Drafts for the engine's speculative-decoding tests: a seeded EAGLE-3 head on a target, and an
oracle that knows the greedy continuation and proposes a wrong token at every third position
(so every verification sees accepted and rejected proposals)."""

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig

from onboard.engine.llm_engine import LLMEngine
from onboard.engine.spec_decode import Speculator
from onboard.speculator.draft import Eagle3Draft, draft_layer_config


def seeded_draft(
    path: Path, engine: LLMEngine, vocab: torch.Tensor, seed: int, aux_layers: Sequence[int] = (0, 1)
) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_layer_config(AutoConfig.from_pretrained(path)), len(vocab), list(aux_layers))
    draft.set_vocab(vocab)
    target = engine.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    return draft.eval()


class OracleSpeculator(Speculator):
    """Proposes the known greedy continuation, wrong at every position divisible by 3."""

    def __init__(self, draft: Eagle3Draft, k: int, known: list[int]):
        super().__init__(draft, k)
        self.known = known

    def _rows(self, tokens, hidden, first_position, cache):
        logits, hidden = super()._rows(tokens, hidden, first_position, cache)
        position = first_position + len(tokens)  # of the token the last row predicts
        token = self.known[position] if position < len(self.known) else 0
        forced = torch.full_like(logits, -1e9)
        forced[token + 1 if position % 3 == 0 else token] = 0.0  # the full vocabulary: index == id
        return forced, hidden
