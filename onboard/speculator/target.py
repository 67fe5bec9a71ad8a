"""What the draft takes of its target: the embedding, the output head, the final norm and (warm
start) the last decoder layer, from the engine that serves the target or, for a target larger
than memory, from the checkpoint's own tensors (`StreamedModel`), without an engine.

Both give the same values: the engine's float32 copies are of its bf16 weights, and the
checkpoint's tensors are read, cast to the streamed dtype (bf16, as the engine holds them) and
copied into the float32 draft; a compressed-tensors last layer is decompressed as the engine
dequantizes it.
"""

import torch

from onboard.console import console
from onboard.models.streamed import StreamedModel
from onboard.speculator.draft import Eagle3Draft, draft_layer_config
from onboard.speculator.warm_start import (
    checkpoint_layer_notes,
    checkpoint_layer_weights,
    describe,
    describe_init,
    init_from_last_layer,
    init_from_weights,
)


def new_draft(config, tensors: dict[str, torch.Tensor], vocab: torch.Tensor, aux_layers: list[int]) -> Eagle3Draft:
    """A seeded draft of `config`'s shapes over the draft vocabulary `vocab`, started from the
    target's `embed_tokens`, `lm_head` and `norm` (`tensors`, any float dtype)."""
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(config), len(vocab), aux_layers)
    draft.set_vocab(vocab)
    draft.init_from_target(tensors["embed_tokens"], tensors["lm_head"], tensors["norm"])
    return draft


def engine_draft(engine, vocab: torch.Tensor, aux_layers: list[int], from_last_layer: bool = False) -> Eagle3Draft:
    draft = new_draft(engine.hf_config, engine.target_tensors(), vocab, aux_layers)
    if from_last_layer:
        console.print(describe_init(engine, init_from_last_layer(draft, engine)))
    return draft


def checkpoint_tensors(model: StreamedModel) -> dict[str, torch.Tensor]:
    """The embedding, the output head (the embedding where tied) and the final norm weight, as
    stored cast to the model's dtype; the head is what training labels the captured states with."""
    return {
        "embed_tokens": model.parts.tensors("model.embed_tokens.")["weight"].to(model.dtype),
        "lm_head": model.head(),
        "norm": model.parts.tensors("model.norm.")["weight"].to(model.dtype),
    }


def checkpoint_draft(
    model: StreamedModel,
    tensors: dict[str, torch.Tensor],
    vocab: torch.Tensor,
    aux_layers: list[int],
    from_last_layer: bool = False,
) -> Eagle3Draft:
    """`engine_draft` from the checkpoint (`tensors`: `checkpoint_tensors(model)`); the warm start
    builds the last decoder layer alone and lets it go."""
    draft = new_draft(model.config, tensors, vocab, aux_layers)
    if from_last_layer:
        layer = model.layer(model.num_layers - 1)
        reason = init_from_weights(draft, checkpoint_layer_weights(layer))
        console.print(describe(reason, checkpoint_layer_notes(layer) if reason is None else []))
        del layer
    return draft
