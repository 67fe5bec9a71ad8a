"""Hidden-state capture for a target larger than memory: the checkpoint streamed one decoder layer
at a time (`onboard.models.streamed`), no engine, nothing generated.

Every sequence is its own batch [1, T], as exact numerics' engine runs each sequence alone, so
the states written are the engine's (`capture_shards` in exact numerics) bit for bit: the same
transformers layer classes, mask and rotary tables, the inputs of the aux layers (the embeddings
for layer 0, else the previous layer's output) and the final norm of the last layer's output.
One pass reads the checkpoint once and holds one decoder layer plus, per token, its running
state, its aux states and its final state (what `budget.estimate` counts); the shards and index
are `capture.py`'s.
"""

import sys
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
import torch.nn.functional as F

from onboard.models.streamed import State, StreamedModel
from onboard.speculator.capture import PACK_TOKENS, SHARD_TOKENS, ShardWriter, packs
from onboard.speculator.data import TrainingSequence

States = tuple[torch.Tensor, list[torch.Tensor]]  # final normed [T, H], aux layers' inputs [T, H] each


@torch.inference_mode()
def streamed_states(
    model: StreamedModel, token_lists: Seq[list[int]], aux_layers: Seq[int], label: str = "hidden states"
) -> list[States]:
    """Per sequence, the final normed hidden states and the inputs of decoder layers `aux_layers`
    (in layer order, as the engine returns them), one pass over the checkpoint: `final_hidden`'s
    loop, with the embedding table read once rather than once per sequence."""
    wanted = set(aux_layers)
    table = model.parts.tensors("model.embed_tokens.")["weight"].to(model.parts.device, model.dtype)
    states: list[State] = [(F.embedding(torch.tensor([ids], device=table.device), table), None) for ids in token_lists]
    del table
    aux: list[list[torch.Tensor]] = [[] for _ in states]
    for index in model.indices(label):
        module = model.layer(index)
        for b, state in enumerate(states):
            if index in wanted:
                aux[b].append(state[0][0])
            states[b] = model.run(module, state)
        del module
    norm = model.norm()
    return [(norm(hidden)[0], inputs) for (hidden, _), inputs in zip(states, aux, strict=True)]


def capture_streamed(
    model: StreamedModel,
    sequences: list[TrainingSequence],
    aux_layers: list[int],
    out_dir: Path,
    shard_tokens: int = SHARD_TOKENS,
    pack_tokens: int = PACK_TOKENS,
) -> dict:
    """`capture_shards`' shards and index from one streamed pass: the same sequences give the same
    files, shards cut where the engine's packs of `pack_tokens` tokens end (its KV cache holding a
    pack, as the stage's engine does)."""
    states = streamed_states(model, [s.token_ids for s in sequences], aux_layers, "speculator: hidden states")
    writer = ShardWriter(out_dir, aux_layers, shard_tokens)
    states.reverse()
    for group in packs([len(s.token_ids) for s in sequences], pack_tokens, sys.maxsize, 1):
        for i in group:
            final, aux = states.pop()  # each sequence's states go once added to a shard
            writer.add(sequences[i], final, aux)
        writer.flush()
    return writer.close()
